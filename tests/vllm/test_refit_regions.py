"""What a rank learns of a refit's blocks from its loaders' reads (``RefitReadCounter.regions``):
the box of each tensor its copies read, and whole where it read any other way."""

from __future__ import annotations

import torch

from nrl_gen_vllm.refit_reads import RefitReadCounter


def test_the_counter_learns_the_box_each_tensor_is_read_in() -> None:
    flat = torch.arange(100.0)
    rows, columns, experts = flat[0:24].view(6, 4), flat[24:48].view(6, 4), flat[48:72].view(2, 3, 4)
    transposed, summed, dry_run = flat[72:84].view(3, 4), flat[84:96].view(3, 4), flat[96:100].view(2, 2)
    counter = RefitReadCounter()
    with counter:
        list(counter.track([("rows", rows), ("columns", columns), ("experts", experts),
                            ("transposed", transposed), ("summed", summed), ("dry_run", dry_run)]))
        torch.empty(2, 4).copy_(rows.narrow(0, 2, 2))
        torch.empty(1, 4).copy_(rows[5:6])  # two reads of one tensor: the box holding both
        torch.empty(6, 2).copy_(columns.narrow(1, 2, 2))
        torch.empty(3, 2).copy_(experts.unsqueeze(0).unbind()[0][1].narrow(1, 0, 2))
        torch.empty(4, 3).copy_(transposed.t())
        _ = summed.narrow(0, 1, 1) * 2
        torch.empty(1, 2, device="meta").copy_(dry_run[1:])  # vLLM's meta dry run: a box, no bytes
    assert counter.regions == {"rows": [[2, 6], [0, 4]], "columns": [[0, 6], [2, 4]],
                               "experts": [[1, 2], [0, 3], [0, 2]], "transposed": None, "summed": None,
                               "dry_run": [[1, 2], [0, 2]]}
    assert counter.bytes_read["dry_run"] == 0 and counter.bytes_read["rows"] == 12 * 4
