"""The sliding puzzle: an N x N board of tiles 1..N²-1 and one empty cell (0), solved when the tiles
read in order row by row with the empty cell last. Moves slide a tile next to the empty cell into it.
"""

from __future__ import annotations

import random
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

DIRECTIONS = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}
"""A direction names where the tile moves: ``up`` slides the tile below the empty cell up into it."""

_ACTION = re.compile(r"<action>(.*?)</action>", re.IGNORECASE | re.DOTALL)


@dataclass
class Board:
    grid: list[list[int]]

    @property
    def size(self) -> int:
        return len(self.grid)

    @staticmethod
    def solved_board(size: int) -> Board:
        return Board([[(r * size + c + 1) % (size * size) for c in range(size)] for r in range(size)])

    @staticmethod
    def from_state(state: dict[str, Any]) -> Board:
        return Board([list(row) for row in state["grid"]])

    def state(self) -> dict[str, Any]:
        return {"size": self.size, "grid": [list(row) for row in self.grid]}

    def empty(self) -> tuple[int, int]:
        return next((r, c) for r, row in enumerate(self.grid) for c, v in enumerate(row) if v == 0)

    def solved(self) -> bool:
        return self.grid == Board.solved_board(self.size).grid

    def neighbours(self) -> list[tuple[str, tuple[int, int]]]:
        """The directions that can be played now, with the cell of the tile each one moves."""
        er, ec = self.empty()
        cells = [(name, (er + dr, ec + dc)) for name, (dr, dc) in DIRECTIONS.items()]
        return [(name, (r, c)) for name, (r, c) in cells if 0 <= r < self.size and 0 <= c < self.size]

    def slide(self, cell: tuple[int, int]) -> int:
        """Move the tile at ``cell`` (next to the empty cell) into it; returns the tile."""
        (er, ec), (r, c) = self.empty(), cell
        tile = self.grid[r][c]
        self.grid[er][ec], self.grid[r][c] = tile, 0
        return tile

    def render(self) -> str:
        width = len(str(self.size * self.size - 1))
        border = "  +" + "-" * ((width + 2) * self.size) + "+"
        lines = ["", border]
        for r, row in enumerate(self.grid):
            cells = "".join(" " * (width + 2) if v == 0 else f" {v:>{width}} " for v in row)
            lines.append(f"{r + 1} |{cells}|")
        lines.append(border)
        lines.append("    " + "".join(f"{c + 1:^{width + 2}}" for c in range(self.size)))
        return "\n".join(lines)


def shuffled(size: int, moves: int, rng: random.Random) -> Board:
    """The solved board after ``moves`` random legal slides."""
    board = Board.solved_board(size)
    for _ in range(moves):
        _, cell = rng.choice(board.neighbours())
        board.slide(cell)
    return board


def play(board: Board, action: str) -> str:
    """Apply ``action`` (a direction or ``slide <row> <col>``, 1-based) and say what happened."""
    words = action.strip().lower().split()
    if words and words[0] == "slide":
        try:
            row, col = int(words[1]) - 1, int(words[2]) - 1
            if len(words) != 3:
                raise ValueError
        except (IndexError, ValueError):
            return "Invalid input format. Use: slide row col"
        if not (0 <= row < board.size and 0 <= col < board.size):
            return f"Invalid position. Row/column must be between 1 and {board.size}."
        er, ec = board.empty()
        if abs(er - row) + abs(ec - col) != 1:
            return "Tile must be adjacent to the empty space."
        return f"Slid tile {board.slide((row, col))} into the empty space."
    if len(words) == 1 and words[0] in DIRECTIONS:
        cell = dict(board.neighbours()).get(words[0])
        if cell is None:
            return f"Cannot slide {words[0]}."
        return f"Slid tile {board.slide(cell)} {words[0]}."
    return "Unknown command. Type 'help' to see available commands."


def parse_action(text: str) -> str | None:
    """The content of the last ``<action>...</action>`` in ``text``; None without a complete one."""
    found = _ACTION.findall(text)
    return found[-1].strip() if found else None


def first_move(board: Board, limit: int = 12) -> str | None:
    """A first direction of a shortest solution (breadth-first, at most ``limit`` moves); None if
    solved already or farther away."""
    start = tuple(v for row in board.grid for v in row)
    goal = tuple(v for row in Board.solved_board(board.size).grid for v in row)
    if start == goal:
        return None
    seen = {start}
    frontier: deque[tuple[tuple[int, ...], str, int]] = deque([(start, "", 0)])
    while frontier:
        flat, first, depth = frontier.popleft()
        if depth >= limit:
            continue
        here = Board([list(flat[r * board.size:(r + 1) * board.size]) for r in range(board.size)])
        for name, cell in here.neighbours():
            nxt = Board([list(row) for row in here.grid])
            nxt.slide(cell)
            key = tuple(v for row in nxt.grid for v in row)
            if key == goal:
                return first or name
            if key not in seen:
                seen.add(key)
                frontier.append((key, first or name, depth + 1))
    return None
