"""Registers the ``sliding_puzzle_game`` environment, its generator and its processor with nrl."""

from __future__ import annotations

from nrl_core.api import DataProcessorSpec, DatasetGeneratorSpec, EnvironmentSpec, Field, Section, hookimpl

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)

SCHEMA = Section(doc="NeMo RL's sliding puzzle game (env.sliding_puzzle_game).", fields={
    "cfg": Section(doc="the game", fields={
        "game_config": Section(doc="how puzzles are drawn (for a recipe that names no puzzle data, as NeMo RL's runner draws them)", fields={
            "size": Field(type=int, default=4, minimum=2, doc="the largest board size"),
            "shuffle_moves": Field(type=int, default=100, minimum=1, doc="the most shuffle moves"),
        }),
        "max_moves": Field(type=int, default=50, minimum=1, doc="moves an episode may make before it ends unsolved"),
    }),
})


@hookimpl
def nrl_environments() -> list[EnvironmentSpec]:
    return [EnvironmentSpec(name="sliding_puzzle_game", environment="nrl_env_sliding_puzzle.environment:SlidingPuzzleEnvironment",
                            config_schema=SCHEMA, distribution="nrl-env-sliding-puzzle", multi_turn=True,
                            runner_data="nrl_env_sliding_puzzle.data:runner_data",
                            description="slide tiles until the board is solved, one move per turn (multi-turn)")]


@hookimpl
def nrl_dataset_generators() -> list[DatasetGeneratorSpec]:
    return [DatasetGeneratorSpec(name="sliding_puzzle", generator="nrl_env_sliding_puzzle.data:puzzle_splits",
                                 distribution="nrl-env-sliding-puzzle",
                                 description="seeded shuffled boards, with a first move of a shortest solution")]


@hookimpl
def nrl_data_processors() -> list[DataProcessorSpec]:
    return [DataProcessorSpec(name="sliding_puzzle", processor="nrl_env_sliding_puzzle.data:puzzle_processor",
                              distribution="nrl-env-sliding-puzzle",
                              description="a puzzle's prompt; its board goes to the episode's metadata")]
