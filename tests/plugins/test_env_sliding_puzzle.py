"""The sliding puzzle (nrl-env-sliding-puzzle): NeMo RL's rules, rewards and episode ends, the
seeded puzzle generator and its SFT targets."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("nrl_env_sliding_puzzle")

from nrl_core.contracts import Episode, MultiTurnEnvironment  # noqa: E402
from nrl_env_sliding_puzzle.data import puzzle_splits  # noqa: E402
from nrl_env_sliding_puzzle.environment import SlidingPuzzleEnvironment  # noqa: E402
from nrl_env_sliding_puzzle.game import Board, first_move, parse_action, play, shuffled  # noqa: E402

ONE_AWAY = {"size": 2, "grid": [[1, 2], [0, 3]]}  # 'left' slides 3 into the empty cell: solved


def test_boards_render_and_moves_follow_nemo_rl_s_rules():
    board = Board.solved_board(3)
    assert board.solved() and board.grid == [[1, 2, 3], [4, 5, 6], [7, 8, 0]]
    assert board.render().splitlines() == ["", "  +---------+", "1 | 1  2  3 |", "2 | 4  5  6 |",
                                           "3 | 7  8    |", "  +---------+", "     1  2  3 "]
    assert play(board, "left") == "Cannot slide left."  # nothing right of the empty cell
    assert play(board, "down") == "Slid tile 6 down." and board.grid[2][2] == 6 and board.grid[1][2] == 0
    assert play(board, "slide 3 3") == "Slid tile 6 into the empty space." and board.solved()
    assert play(board, "slide 1 1") == "Tile must be adjacent to the empty space."
    assert play(board, "slide 9 1") == "Invalid position. Row/column must be between 1 and 3."
    assert play(board, "slide one") == "Invalid input format. Use: slide row col"
    assert play(board, "jump") == "Unknown command. Type 'help' to see available commands."
    assert parse_action("<action>up</action> then <ACTION> left </action>") == "left"
    assert parse_action("<action>up") is None


def test_a_shortest_solution_s_first_move_solves_one_move_boards():
    rng = random.Random(3)
    for _ in range(20):
        board = shuffled(3, 1, rng)
        move = first_move(board)
        play(board, move)
        assert board.solved()
    assert first_move(Board.solved_board(2)) is None


def episode(response: str, state: dict = ONE_AWAY, moves: int = 0) -> Episode:
    return Episode(prompt="p", messages=[{"role": "assistant", "content": response}],
                   metadata={"game_state": state, "num_moves": moves}, turn=1)


def test_the_environment_rewards_only_a_solve_and_counts_moves_as_nemo_rl_does():
    env = SlidingPuzzleEnvironment({"cfg": {"max_moves": 2, "game_config": {"size": 2, "shuffle_moves": 1}}})
    assert isinstance(env, MultiTurnEnvironment)
    solved, wrong, garbled, view, spent = env.step([episode("<action>left</action>"), episode("<action>up</action>"),
                                                   episode("left"), episode("<action>view</action>"),
                                                   episode("<action>left</action>", moves=2)])
    assert (solved.reward, solved.done, solved.metadata["num_moves"]) == (1.0, True, 1)
    assert (wrong.reward, wrong.done, wrong.metadata["num_moves"]) == (0.0, False, 1)  # an illegal move costs one
    assert wrong.observation.startswith("<environment>\nCannot slide up.") and wrong.stop_strings == ["</action>"]
    assert garbled.metadata is None and "Invalid response format no move made" in garbled.observation
    assert view.metadata is None and "Viewing the board. No move made." in view.observation
    assert (spent.reward, spent.done, spent.observation) == (0.0, True, "<error>Maximum moves (2) reached.</error>")


def test_generated_puzzles_are_seeded_never_solved_and_carry_their_first_move():
    train, val = puzzle_splits(num_train=30, num_val=5, size=3, shuffle_moves=3, seed=7)
    assert (len(train), len(val)) == (30, 5) and puzzle_splits(num_train=30, num_val=5, size=3, shuffle_moves=3,
                                                               seed=7)[0] == train
    for record in train + val:
        board = Board.from_state(json.loads(record["game_state"]))
        assert not board.solved() and 2 <= board.size <= 3
        assert record["expected_answer"] == f"<action>{first_move(board)}</action>"
        assert board.render() in record["problem"]
    with pytest.raises(TypeError, match="size must be at least 2"):
        puzzle_splits(size=1)


def test_nemo_rl_s_recipe_trains_on_the_puzzles_its_runner_draws_not_on_the_math_data_it_inherits(caplog,
                                                                                                   monkeypatch):
    """NeMo RL's grpo_sliding_puzzle.yaml inherits OpenMathInstruct-2 from grpo_math_1B.yaml, which its
    runner never reads: it draws puzzles from env.sliding_puzzle_game.cfg.game_config. nrl does the same."""
    from pathlib import Path

    from nrl_core.config import load_and_validate
    from nrl_core.data.splits import load_data_splits
    from nrl_core.plugins import get_plugin_manager

    recipe = Path(__file__).resolve().parents[1] / "examples" / "nemo_rl_configs" / "configs" / "grpo_sliding_puzzle.yaml"
    pm = get_plugin_manager()
    monkeypatch.setattr("nrl_core.config.runner_data._NOTED", set())  # its warning is once per process
    config = load_and_validate(str(recipe), ["grpo.max_num_steps=3", "grpo.max_val_samples=4"], pm, algorithm="grpo")
    data = config["data"]
    assert (data["dataset_name"], data["processor"], data["env_name"]) == ("sliding_puzzle", "sliding_puzzle",
                                                                          "sliding_puzzle_game")
    assert data["train"] is None and data["generate"] == {"num_train": 32 * 3, "num_val": 4, "size": 5,
                                                          "shuffle_moves": 10, "seed": 42, "solve": False}
    assert config["policy"]["generation"]["stop_strings"] == ["</action>"]  # NeMo RL's datums stop there
    assert "OpenMathInstruct-2 is not read" in caplog.text
    splits = load_data_splits(data, pm)
    assert len(splits.train) == 96 and len(splits.val) == 4
    assert all(json.loads(r["game_state"])["size"] in range(2, 6) and "Board:" in r["problem"] for r in splits.train)
    # a config that names the puzzle data (nrl's own twin of the recipe) keeps its own
    ours = load_and_validate(str(recipe.parents[4] / "examples" / "configs" / "grpo_sliding_puzzle_tiny_cpu.yaml"),
                             [], pm, algorithm="grpo")
    assert ours["data"]["generate"] == {"num_train": 1024, "num_val": 128, "size": 2, "shuffle_moves": 3, "seed": 0}
    # a twin's fewer puzzles are kept; a key of another generator is not
    twin = load_and_validate(str(recipe), ["++data.generate={num_train: 5, min_operand: 0}"], pm, algorithm="grpo")
    assert twin["data"]["generate"]["num_train"] == 5 and "min_operand" not in twin["data"]["generate"]
