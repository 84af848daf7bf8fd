"""Sequence packing and dynamic batching (core, backend-independent)."""

import pytest
import torch

from nrl_core.data import PACKING_ALGORITHMS, dynamic_micro_batches, pack_bins, pack_sequences
from nrl_core.errors import NrlError

LENGTHS = [5, 17, 3, 31, 8, 12, 29, 1, 16, 9, 22, 2]


@pytest.mark.parametrize("algorithm", list(PACKING_ALGORITHMS))
def test_bins_cover_every_sequence_within_budget(algorithm):
    bins = pack_bins(LENGTHS, 32, algorithm, round_to=2, seed=3)
    assert sorted(i for b in bins for i in b) == list(range(len(LENGTHS)))
    assert all(sum(-(-LENGTHS[i] // 2) * 2 for i in b) <= 32 for b in bins)
    assert len(bins) < len(LENGTHS)


def test_packing_errors_are_one_line():
    with pytest.raises(NrlError, match="exceeds the packing budget"):
        pack_bins([40], 32)
    with pytest.raises(NrlError, match="unknown sequence packing algorithm"):
        pack_bins([4], 32, "best_fit")


def test_pack_resets_positions_and_unpacks():
    ids = torch.arange(1, 31).reshape(3, 10)
    lengths = torch.tensor([4, 10, 3])
    packed = pack_sequences(ids, lengths, [[1], [0, 2]], pad_id=0, round_to=4, row_width=12)
    assert packed.position_ids[1].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    assert packed.input_ids[1, :7].tolist() == [1, 2, 3, 4, 21, 22, 23]
    back = packed.unpack(packed.input_ids.float(), 3, 10)
    expected = torch.where(torch.arange(10)[None] < lengths[:, None], ids, 0).float()
    assert torch.equal(back, expected)


def test_dynamic_batches_respect_budget():
    groups = dynamic_micro_batches(LENGTHS, 64, round_to=4)
    assert sorted(i for g in groups for i in g) == list(range(len(LENGTHS)))
    for g in groups:
        assert len(g) * -(-max(LENGTHS[i] for i in g) // 4) * 4 <= 64
    with pytest.raises(NrlError, match="exceeds the dynamic batching budget"):
        dynamic_micro_batches([100], 64)
