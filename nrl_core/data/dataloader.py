"""Batches of prompts for an algorithm's step loop, shuffled by seed and resumable exactly.

Why not ``torch.utils.data.DataLoader``: a resumed run must continue with the very batch the
interrupted run would have taken next. Here the order of epoch ``e`` is a pure function of
``(seed, e)``, so the whole position is two integers (``epoch``, ``index``) that go into the
checkpoint's training state, and nothing else needs saving.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from nrl_core.errors import NrlError

__all__ = ["PromptDataloader"]

T = TypeVar("T")


class PromptDataloader(Generic[T]):
    """Batches of ``batch_size`` items of ``data``.

    Iterating yields the batches left in the current epoch and then moves to the next epoch, so
    ``for epoch ...: for batch in loader: ...`` reads like NeMo RL's loop. The position advances
    when a batch is handed out: a ``state_dict()`` taken after processing a batch resumes with the
    batch after it. ``drop_last`` (default) keeps every batch full, which GRPO's group arithmetic
    wants; validation uses ``shuffle=False, drop_last=False``.
    """

    def __init__(self, data: Sequence[T], batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        if batch_size < 1:
            raise NrlError(f"batch size must be >= 1, got {batch_size}")
        if drop_last and len(data) < batch_size:
            raise NrlError(f"the dataset has {len(data)} prompts, fewer than one batch of {batch_size}; "
                           "add data or lower the batch size (grpo.num_prompts_per_step)")
        if not data:
            raise NrlError("the dataset is empty")
        self._data = data
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0  # batches already handed out in the current epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self._data), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> list[int]:
        """The item order of ``epoch``: a pure function of ``(seed, epoch)``."""
        indices = list(range(len(self._data)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(indices)
        return indices

    def __iter__(self) -> Iterator[list[T]]:
        order = self.order(self.epoch)
        while self.index < len(self):
            start = self.index * self.batch_size
            batch = [self._data[i] for i in order[start:start + self.batch_size]]
            self.index += 1
            yield batch
        self.epoch += 1
        self.index = 0

    def next_batch(self) -> list[T]:
        """The next batch, crossing into the next epoch when this one is used up."""
        if self.index >= len(self):
            self.epoch += 1
            self.index = 0
        return next(iter(self))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "num_samples": len(self._data)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``. Resuming over different data or batching would silently train
        on other batches than the interrupted run, so a mismatch is an error."""
        mine = self.state_dict()
        for key in ("seed", "shuffle", "batch_size", "num_samples"):
            if key in state and state[key] != mine[key]:
                raise NrlError(f"cannot resume the dataloader: the checkpoint has {key}={state[key]!r} but this run "
                               f"has {key}={mine[key]!r}; resume with the same data and settings")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
