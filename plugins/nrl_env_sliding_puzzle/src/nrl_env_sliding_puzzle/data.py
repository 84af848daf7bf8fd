"""Puzzles as data: the ``sliding_puzzle`` generator (``data.dataset_name``) and processor
(``data.processor``), drawn as NeMo RL's recipe draws them: a size from 2 to ``size`` and an odd
number of shuffle moves from 1 to ``shuffle_moves`` (so no board starts solved)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

from nrl_core.api import DatumSpec, PromptConfig, build_prompt
from nrl_env_sliding_puzzle.game import Board, first_move, shuffled

INSTRUCTIONS = ("Slide tiles into the empty space until 1 to {last} are in order, empty last. One action per "
                "turn: <action>up</action>, down, left, right (the tile that moves), slide row col, or view.")


def puzzle_prompt(board: Board) -> str:
    return f"{INSTRUCTIONS.format(last=board.size * board.size - 1)}\nBoard:{board.render()}\n"


def puzzle_record(rng: random.Random, size: int, shuffle_moves: int, *, solve: bool = True) -> dict[str, Any]:
    """One puzzle: the prompt, a first move of a shortest solution (an SFT target; empty without
    ``solve``, which GRPO does not read) and the board."""
    moves = rng.randint(1, shuffle_moves)
    moves += moves % 2 == 0  # an odd number of moves never leaves the board solved
    board = shuffled(rng.randint(2, size), moves, rng)
    while board.solved():
        board = shuffled(board.size, moves, rng)
    answer = f"<action>{first_move(board)}</action>" if solve else ""
    return {"problem": puzzle_prompt(board), "expected_answer": answer, "game_state": json.dumps(board.state())}


def puzzle_splits(num_train: int = 512, num_val: int = 64, size: int = 2, shuffle_moves: int = 1,
                  seed: int = 0, solve: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``data.generate`` keywords: how many puzzles, the largest size and shuffle count, the seed,
    and whether to solve each for its first move (SFT's target, a search that grows with the board)."""
    if size < 2 or shuffle_moves < 1:
        raise TypeError("size must be at least 2 and shuffle_moves at least 1")
    rng = random.Random(seed)
    records = [puzzle_record(rng, size, shuffle_moves, solve=solve) for _ in range(num_train + num_val)]
    return records[:num_train], records[num_train:]


def runner_data(section: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The data of NeMo RL's ``run_grpo_sliding_puzzle.py``, which reads no ``data`` section: puzzles
    drawn from ``cfg.game_config``, as many as its steps take prompts (and ``max_val_samples`` to
    validate on), each episode's first reply stopping at ``</action>``."""
    grpo = config.get("grpo") or {}
    game = section["cfg"]["game_config"]
    generate = {"num_train": int(grpo.get("num_prompts_per_step", 1)) * int(grpo.get("max_num_steps", 1)),
                "num_val": int(grpo.get("max_val_samples") or 0), "size": int(game["size"]),
                "shuffle_moves": int(game["shuffle_moves"]), "seed": int(grpo.get("seed") or 0), "solve": False}
    return {"data.dataset_name": "sliding_puzzle", "data.processor": "sliding_puzzle", "data.generate": generate,
            "policy.generation.stop_strings": ["</action>"]}


def puzzle_processor(record: Mapping[str, Any], idx: int, tokenizer: Any, cfg: PromptConfig) -> DatumSpec:
    """The puzzle's prompt; the board goes to the episode's metadata."""
    text, ids = build_prompt(str(record["problem"]), tokenizer, cfg)
    return DatumSpec(idx=idx, prompt_text=text, prompt_ids=ids,
                     metadata={"game_state": json.loads(record["game_state"]), "num_moves": 0})
