"""``env.sliding_puzzle_game``: one board per episode, one move per turn, reward 1 when solved."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.api import EnvStep, Episode
from nrl_env_sliding_puzzle.game import Board, parse_action, play

STOP = ["</action>"]


class SlidingPuzzleEnvironment:
    """NeMo RL's rules: a reply without a complete ``<action>`` tag, or ``view``, shows the board
    and costs no move; any other action costs a move, legal or not; the episode ends solved
    (reward 1) or once ``max_moves`` moves were made (reward 0). Rewards come only from solving."""

    def __init__(self, section: Mapping[str, Any]) -> None:
        self.max_moves = int(section["cfg"]["max_moves"])

    def step(self, episodes: list[Episode]) -> list[EnvStep]:
        return [self._turn(episode) for episode in episodes]

    def _turn(self, episode: Episode) -> EnvStep:
        moves = int(episode.metadata.get("num_moves", 0))
        if moves >= self.max_moves:
            return EnvStep(observation=f"<error>Maximum moves ({self.max_moves}) reached.</error>", done=True)
        board = Board.from_state(episode.metadata["game_state"])
        action = parse_action(episode.last_response)
        if action is None:
            return self._show(board, "Invalid response format no move made. Try <action></action> like this: "
                                     "<action>your_action</action>", episode, {"invalid_format": 1.0})
        if action.lower() == "view":
            return self._show(board, "Viewing the board. No move made.", episode, {"invalid_format": 0.0})
        message = play(board, action)
        metadata = {**episode.metadata, "game_state": board.state(), "num_moves": moves + 1}
        if board.solved():
            return EnvStep(reward=1.0, done=True, metadata=metadata, metrics={"invalid_format": 0.0})
        return EnvStep(observation=f"<environment>\n{message}\n</environment>\n",
                       metadata=metadata, stop_strings=STOP, metrics={"invalid_format": 0.0})

    @staticmethod
    def _show(board: Board, message: str, episode: Episode, metrics: dict[str, float]) -> EnvStep:
        return EnvStep(observation=f"<environment>\n{board.render()}\n\n{message}</environment>\n",
                       stop_strings=STOP, metrics=metrics)

    def shutdown(self) -> None:
        pass
