"""Every loss formula at two data-parallel ranks, packed and padded, equals a direct computation of
the same loss over the whole batch: the token and sequence counts that normalise each micro-batch
are the whole optimizer step's, on every rank (NeMo RL's normalisation)."""

from __future__ import annotations

import pytest
from scenarios import LOSS_VARIANTS, loss_variants

from nrl_core.algorithms.loss import ClippedPGLoss
from nrl_core.testing.distributed import run_distributed

# The training forward's logprobs equal get_logprobs' within the conformance kit's 1e-5; the
# metrics are sums over micro-batches and ranks in float32.
TOLERANCE = 2e-5
METRICS = ("loss", "pg_loss", "kl_penalty", "probs_ratio", "sampling_importance_ratio", "token_mult_prob_error",
           "num_valid_samples", "is_oob_ratio")


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_two_ranks_report_the_loss_of_the_whole_batch(packing):
    ranks = run_distributed(loss_variants, 2, packing)
    checked = 0
    for name, keys in LOSS_VARIANTS.items():
        run = ranks[0][name]
        batch = run["batch"]
        tokens, seqs = batch.loss_counts()
        _, direct = ClippedPGLoss(**keys)(run["logprobs"].double(), batch, global_valid_tokens=tokens,
                                          global_valid_seqs=seqs)
        for key in METRICS:
            if key in direct:
                for rank in ranks:
                    assert rank[name]["metrics"][key] == pytest.approx(direct[key], rel=TOLERANCE, abs=TOLERANCE), (
                        f"{name}: {key}")
                checked += 1
    assert checked >= 4 * 6
