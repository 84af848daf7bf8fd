"""The prompt dataloader: seeded shuffling, epochs, and exact resumption."""

from __future__ import annotations

import itertools

import pytest

from nrl_core.data.dataloader import PromptDataloader
from nrl_core.errors import NrlError

DATA = list(range(10))


def take(loader: PromptDataloader, n: int) -> list[list[int]]:
    """``n`` batches, crossing epochs the way an algorithm's loop does."""
    return [loader.next_batch() for _ in range(n)]


def test_an_epoch_covers_each_item_once_in_a_seeded_order():
    loader = PromptDataloader(DATA, 3, seed=5)
    epoch0 = list(loader)
    assert len(epoch0) == len(loader) == 3 and all(len(b) == 3 for b in epoch0)
    flat = list(itertools.chain(*epoch0))
    assert len(set(flat)) == 9 and flat != sorted(flat)
    assert loader.epoch == 1 and loader.index == 0
    assert list(loader) != epoch0  # a new order each epoch
    assert list(PromptDataloader(DATA, 3, seed=5)) == epoch0
    assert list(PromptDataloader(DATA, 3, seed=6)) != epoch0


def test_resume_continues_with_the_same_batches():
    reference = PromptDataloader(DATA, 3, seed=11)
    expected = take(reference, 8)  # crosses two epoch boundaries

    first = PromptDataloader(DATA, 3, seed=11)
    seen = take(first, 4)
    state = first.state_dict()
    assert state["epoch"] == 1 and state["index"] == 1
    resumed = PromptDataloader(DATA, 3, seed=11)
    resumed.load_state_dict(state)
    assert seen + take(resumed, 4) == expected


def test_resume_mid_epoch_through_iteration():
    loader = PromptDataloader(DATA, 2, seed=0)
    it = iter(loader)
    first_two = [next(it), next(it)]
    resumed = PromptDataloader(DATA, 2, seed=0)
    resumed.load_state_dict(loader.state_dict())
    assert first_two + list(resumed) == list(PromptDataloader(DATA, 2, seed=0))


def test_resume_with_other_data_or_settings_is_refused():
    state = PromptDataloader(DATA, 3, seed=1).state_dict()
    with pytest.raises(NrlError, match=r"checkpoint has num_samples=10 but this run has num_samples=11"):
        PromptDataloader(list(range(11)), 3, seed=1).load_state_dict(state)
    with pytest.raises(NrlError, match=r"checkpoint has seed=1 but this run has seed=2"):
        PromptDataloader(DATA, 3, seed=2).load_state_dict(state)


def test_validation_order_and_last_partial_batch():
    loader = PromptDataloader(DATA, 4, shuffle=False, drop_last=False)
    assert list(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_too_little_data_is_an_error():
    with pytest.raises(NrlError, match=r"^the dataset has 2 prompts, fewer than one batch of 3"):
        PromptDataloader([1, 2], 3)
