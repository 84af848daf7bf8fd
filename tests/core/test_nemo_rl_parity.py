"""NeMo RL's own loss and advantage unit-test cases, restated as nrl parity tests.

Source of truth: NeMo RL at commit 7ea279a (tests/unit/algorithms/test_loss_functions.py,
test_utils.py, test_grpo.py's GRPOAdvantageEstimator tests, and the implementations in
nemo_rl/algorithms/loss/loss_functions.py, nemo_rl/algorithms/utils.py and
nemo_rl/algorithms/advantage_estimator.py). No NeMo RL code is copied: each test restates the
NeMo RL case's inputs and expected values, and computes expectations directly with torch/math.
Every test names the NeMo RL test (or, marked "implementation", the NeMo RL code path) it
reproduces, so a drift of nrl from NeMo RL's semantics shows up as a failing test here.

Layout. NeMo RL's per-token data fields are [B, S] and its loss slices them ``[:, 1:]`` against
next-token logprobs [B, S-1]. nrl's logprobs and fields are aligned with ``input_ids``: [B, S],
column 0 being the first prompt token (logprob 0, token_mask 0). The helpers below take NeMo RL's
next-token parts (what NeMo RL's tests write into ``data[...][:, 1:]``) and prepend that column.

Tolerances. Expectations computed here in float64 are compared with ``rel=1e-6``: nrl normalises
by ``max(count, 1)`` where NeMo RL divides by ``count + 1e-8``, a relative difference of at most
~1e-8 at these counts. NeMo RL's own rounded hand values (e.g. -0.6333) are checked at their
``rtol=1e-3``.
"""

from __future__ import annotations

import math

import pytest
import torch

from nrl_core.algorithms.advantages import baseline_and_std, group_advantages, prompt_group_ids
from nrl_core.algorithms.dpo_loss import DPOLoss
from nrl_core.algorithms.loss import ClippedPGLoss, NLLLoss, kl_estimate
from nrl_core.contracts import TokenBatch

F64 = torch.float64
REL = 1e-6

# float(loss) on a loss that still requires grad: harmless here, the tests read values and grads
pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

# ------------------------------------------------------------------------------------- helpers


def _t(rows) -> torch.Tensor:
    t = torch.as_tensor(rows, dtype=F64)
    return t.unsqueeze(0) if t.dim() == 1 else t


def _with_prompt_column(next_token_rows) -> torch.Tensor:
    """NeMo RL next-token part [B, S-1] -> nrl [B, S] (column 0: the first prompt token, value 0)."""
    t = _t(next_token_rows)
    return torch.cat([torch.zeros(t.shape[0], 1, dtype=F64), t], dim=1)


def _pg_batch(adv, prev=None, gen=None, ref=None, token_mask=None, sample_mask=None) -> TokenBatch:
    """NeMo RL's ``_setup_clipped_pg_test_data`` in nrl's layout. Every per-token argument is the
    next-token part NeMo RL's tests write into ``data[key][:, 1:]``; omitted ones are zeros, as
    NeMo RL's defaults are; token_mask defaults to all ones (NeMo RL's [0, 1, 1, 1] sliced)."""
    adv = _with_prompt_column(adv)
    B, S = adv.shape
    zeros = torch.zeros(B, S - 1, dtype=F64)
    tm = _with_prompt_column(zeros + 1 if token_mask is None else token_mask)
    fields = {
        "advantages": adv,
        "prev_logprobs": _with_prompt_column(zeros if prev is None else prev),
        "generation_logprobs": _with_prompt_column(zeros if gen is None else gen),
        "reference_logprobs": _with_prompt_column(zeros if ref is None else ref),
        "token_mask": tm.float(),
        "sample_mask": (torch.ones(B) if sample_mask is None else torch.as_tensor(sample_mask)).float(),
    }
    return TokenBatch(input_ids=torch.zeros(B, S, dtype=torch.long), input_lengths=torch.full((B,), S), fields=fields)


def _nemo_counts(batch: TokenBatch) -> tuple[float, float]:
    """NeMo RL's normalisers as its tests pass them: global_valid_toks = sum(token_mask[:, 1:] *
    sample_mask), global_valid_seqs = sum(sample_mask). Computed here, not by
    ``TokenBatch.loss_counts`` (tested on its own below), so a loss test fails only for the loss."""
    tm, sm = batch.fields["token_mask"].double(), batch.fields["sample_mask"].double()
    return float((tm[:, 1:] * sm[:, None]).sum()), float(sm.sum())


def _run(loss_fn, curr, batch, counts=None):
    """Call an nrl loss with NeMo RL's next-token logprobs ``curr`` [B, S-1]; returns the loss, the
    metrics and the leaf tensor of ``curr`` (for gradients)."""
    leaf = _t(curr).clone().requires_grad_(True)
    logprobs = torch.cat([torch.zeros(leaf.shape[0], 1, dtype=F64), leaf], dim=1)
    toks, seqs = _nemo_counts(batch) if counts is None else counts
    loss, metrics = loss_fn(logprobs, batch, global_valid_tokens=toks, global_valid_seqs=seqs)
    return loss, metrics, leaf


def _grad(loss, leaf) -> torch.Tensor:
    loss.backward()
    return leaf.grad


def _autograd(fn, curr) -> torch.Tensor:
    """Expected gradient: autograd on a direct float64 restatement of NeMo RL's formula."""
    x = _t(curr).clone().requires_grad_(True)
    fn(x).backward()
    return x.grad


def _close(actual, expected, rel=REL, abs_=1e-12):
    a = torch.as_tensor(actual, dtype=F64).detach()
    e = torch.as_tensor(expected, dtype=F64).detach()
    torch.testing.assert_close(a, e.expand_as(a) if e.dim() == 0 else e, rtol=rel, atol=abs_)


def _k3(logr):
    return torch.exp(logr) - 1 - logr


def _ppo_token_loss(curr, prev, adv, lo=0.2, hi=0.2):
    """NeMo RL's clipped surrogate per token: max(-A r, -A clip(r, 1 - lo, 1 + hi))."""
    r = torch.exp(curr - prev)
    return torch.maximum(-adv * r, -adv * r.clamp(1 - lo, 1 + hi))


# NeMo RL's recurring numbers (test_clipped_pg_loss_ppo_clipping and friends): ratios 0.5, 1.0, 1.5
ADV = [[1.0, -1.0, 2.0]]
PREV = [[-1.0, -1.0, -1.0]]
CURR = [[-1.69315, -1.0, -0.59453]]  # ~ log(0.5) - 1, log(1) - 1, log(1.5) - 1
GEN = [[-0.5, -1.5, -0.8]]
REF = [[-1.0, -1.0, -1.0]]


# ------------------------------------------------------------------------- clipped PG: values


def test_ppo_clipping():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_ppo_clipping (value and gradient)."""
    loss, _, leaf = _run(ClippedPGLoss(), CURR, _pg_batch(ADV, prev=PREV))
    c, p, a = _t(CURR), _t(PREV), _t(ADV)
    _close(loss, _ppo_token_loss(c, p, a).mean())
    assert float(loss) == pytest.approx(-0.6333, rel=1e-3)
    # d/dlp: -A r where the unclipped branch wins (r=0.5, r=1), 0 where the clip wins (r=1.5)
    r = torch.exp(c - p)
    _close(_grad(loss, leaf), torch.tensor([[-1.0 * r[0, 0], 1.0 * r[0, 1], 0.0]], dtype=F64) / 3)


def test_reinforce_mode_disable_ppo_ratio():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_reinforce_mode: disable_ppo_ratio makes
    the per-token loss -A * logprob (value 0.8333, gradient -A / tokens)."""
    curr = [[-0.5, -1.0, -1.5]]
    loss_fn = ClippedPGLoss(disable_ppo_ratio=True, ratio_clip_min=0.0, ratio_clip_max=0.0)
    loss, _, leaf = _run(loss_fn, curr, _pg_batch(ADV, prev=[[0.0, 0.0, 0.0]]))
    _close(loss, (-_t(ADV) * _t(curr)).mean())
    assert float(loss) == pytest.approx(0.8333, rel=1e-3)
    _close(_grad(loss, leaf), -_t(ADV) / 3)


def test_force_on_policy_ratio():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_force_on_policy_ratio: the ratio is
    exp(lp - lp.detach()) = 1 (ratio metrics exactly 1) and its gradient is that of lp."""
    loss, m, leaf = _run(ClippedPGLoss(force_on_policy_ratio=True), CURR, _pg_batch(ADV, prev=PREV))
    _close(loss, -_t(ADV).mean())
    assert float(loss) == pytest.approx(-2 / 3, rel=1e-3)
    assert m["probs_ratio"] == 1.0
    assert m["probs_ratio_clamped"] == 1.0
    _close(_grad(loss, leaf), -_t(ADV) / 3)


def test_force_on_policy_ratio_ignores_prev_logprobs():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_force_on_policy_ratio_ignores_prev_logprobs."""
    curr = [[-1.0, -1.0, -1.0]]
    loss_fn = ClippedPGLoss(force_on_policy_ratio=True)
    loss_1, m_1, _ = _run(loss_fn, curr, _pg_batch([[0.0, 0.0, 0.0]], prev=curr))
    loss_2, m_2, _ = _run(loss_fn, curr, _pg_batch([[0.0, 0.0, 0.0]], prev=[[-10.0, -10.0, -10.0]]))
    _close(loss_1, loss_2)
    assert m_1["probs_ratio"] == m_2["probs_ratio"] == 1.0


@pytest.mark.parametrize(
    "incompatible",
    [
        {"disable_ppo_ratio": True},
        {"force_on_policy_ratio": True},
        {"ratio_clip_c": 3.0},
        {"sequence_level_importance_ratios": True, "token_level_loss": False},
    ],
    ids=["disable_ppo_ratio", "force_on_policy_ratio", "dual_clip", "gspo"],
)
def test_cispo_incompatibility(incompatible):
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_cispo_incompatibility_asserts (NeMo RL
    asserts at construction; nrl raises ValueError)."""
    with pytest.raises(ValueError):
        ClippedPGLoss(use_cispo=True, **incompatible)


def test_cispo():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_cispo: L = -A * sg(clip(r)) * lp; the
    gradient flows only through lp, so it is -A * clip(r) / tokens."""
    loss, _, leaf = _run(ClippedPGLoss(use_cispo=True), CURR, _pg_batch(ADV, prev=PREV))
    c, p, a = _t(CURR), _t(PREV), _t(ADV)
    clipped = torch.exp(c - p).clamp(0.8, 1.2)
    _close(loss, (-a * clipped * c).mean())
    _close(_grad(loss, leaf), -a * clipped / 3)


def test_cispo_with_importance_sampling_correction():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_cispo_with_importance_sampling_correction."""
    loss_fn = ClippedPGLoss(use_cispo=True, use_importance_sampling_correction=True)
    loss, _, _ = _run(loss_fn, CURR, _pg_batch(ADV, prev=PREV, gen=GEN))
    c, p, a, g = _t(CURR), _t(PREV), _t(ADV), _t(GEN)
    _close(loss, (torch.exp(p - g) * -a * torch.exp(c - p).clamp(0.8, 1.2) * c).mean())


def test_dual_clip():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_dual_clip: for A < 0 the loss is capped
    at -A c (40 -> 12 on the third token); value 4.1667, capped token has no gradient."""
    adv, prev, curr = [[1.0, -1.0, -4.0]], [[-1.0, -1.0, -3.0]], [[-1.69315, -1.0, -0.69741]]
    loss, _, leaf = _run(ClippedPGLoss(ratio_clip_c=3.0), curr, _pg_batch(adv, prev=prev))
    c, p, a = _t(curr), _t(prev), _t(adv)
    per_token = _ppo_token_loss(c, p, a)
    per_token = torch.where(a < 0, torch.minimum(per_token, -a * 3.0), per_token)
    _close(loss, per_token.mean())
    assert float(loss) == pytest.approx(4.1667, rel=1e-3)
    r = torch.exp(c - p)
    _close(_grad(loss, leaf), torch.tensor([[-r[0, 0], r[0, 1], 0.0]], dtype=F64) / 3)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_c_must_exceed_one(c):
    """NeMo RL implementation, loss_functions.py ClippedPGLossFn.__call__: asserts ratio_clip_c > 1
    (nrl: ValueError, at construction or at the call)."""
    with pytest.raises(ValueError):
        loss_fn = ClippedPGLoss(ratio_clip_c=c)
        _run(loss_fn, CURR, _pg_batch(ADV, prev=PREV))


def test_approx_entropy_metric():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_entropy:
    approx_entropy = -mean(exp(lp - gen) * lp)."""
    curr, gen, prev = [[-0.5, -1.0, -1.5]], [[-0.6, -1.1, -1.6]], [[-0.4, -0.9, -1.4]]
    _, m, _ = _run(ClippedPGLoss(), curr, _pg_batch([[0.0, 0.0, 0.0]], prev=prev, gen=gen))
    c, g = _t(curr), _t(gen)
    assert m["approx_entropy"] == pytest.approx(float(-(torch.exp(c - g) * c).mean()), rel=REL)


# ---------------------------------------------------------------------------------------- KL


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_calculate_kl(kind):
    """NeMo RL test_loss_functions.py::test_calculate_kl (unclamped, then clamped at 20 in / 10 out)."""
    lp, ref = _t([[-1.0, -1.0, -1.0]]), _t([[-0.0, -15.0, -30.0]])
    unclamped = {"k1": [[-1.0, 14.0, 29.0]], "k2": [[0.5, 98.0, 420.5]], "k3": [[math.e - 2, 13.0, 28.0]]}
    clamped = {"k1": [[-1.0, 10.0, 10.0]], "k2": [[0.5, 10.0, 10.0]], "k3": [[math.e - 2, 10.0, 10.0]]}
    _close(kl_estimate(lp, ref, kind, input_clamp=None, output_clamp=None), _t(unclamped[kind]))
    _close(kl_estimate(lp, ref, kind, input_clamp=20.0, output_clamp=10.0), _t(clamped[kind]))


def test_calculate_kl_detaches_importance_weights_where_input_clamped():
    """NeMo RL test_loss_functions.py::test_calculate_kl_detaches_importance_sampling_when_input_clamped."""
    lp = torch.tensor([[-3.0, -1.0]], dtype=F64, requires_grad=True)
    weights = torch.exp(lp - lp.detach())
    kl = kl_estimate(lp, torch.zeros_like(lp), "k3", input_clamp=2.0, output_clamp=None, importance_weights=weights)
    _close(kl, _t([[math.exp(2) - 3, math.e - 2]]))
    kl.sum().backward()
    # token 0: log-ratio 3 clamped to 2 -> no gradient at all; token 1: kl + dkl/dlp = (e - 2) + (1 - e) = -1
    _close(lp.grad, _t([[0.0, -1.0]]))


def test_calculate_kl_output_clamp_after_importance_weight():
    """NeMo RL test_loss_functions.py::test_calculate_kl_output_clamp_includes_importance_sampling_weight."""
    lp = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    weights = 100.0 * torch.exp(lp - lp.detach())
    kl = kl_estimate(lp, torch.zeros_like(lp), "k3", input_clamp=None, output_clamp=1.0, importance_weights=weights)
    _close(kl, _t([[1.0]]))
    kl.sum().backward()
    _close(lp.grad, _t([[0.0]]))


def test_kl_penalty():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_kl_penalty: k3 KL, beta 0.1, zero
    advantages: loss 0.0362 = 0.1 * mean([0.368, 0, 0.718]); nrl's kl_penalty metric is the raw KL
    (NeMo RL's kl / beta)."""
    curr, ref = [[0.0, -1.0, -2.0]], [[-1.0, -1.0, -1.0]]
    loss, m, _ = _run(ClippedPGLoss(reference_policy_kl_penalty=0.1), curr,
                      _pg_batch([[0.0, 0.0, 0.0]], prev=[[0.0, 0.0, 0.0]], ref=ref))
    kl = _k3(_t(ref) - _t(curr)).mean()
    _close(loss, 0.1 * kl)
    assert float(loss) == pytest.approx(0.0362, rel=1e-3)
    assert m["kl_penalty"] == pytest.approx(float(kl), rel=REL)
    assert m["kl_penalty"] == pytest.approx(0.362, rel=1e-3)


@pytest.mark.parametrize("kind", ["k1", "k2"])
def test_kl_penalty_other_estimators(kind):
    """Variant of NeMo RL test_loss_functions.py::test_clipped_pg_loss_kl_penalty with
    reference_policy_kl_type k1 / k2 (loss_functions.py passes the type to calculate_kl)."""
    curr, ref = [[0.0, -1.0, -2.0]], [[-1.0, -1.0, -1.0]]
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.1, reference_policy_kl_type=kind)
    loss, m, _ = _run(loss_fn, curr, _pg_batch([[0.0, 0.0, 0.0]], prev=[[0.0, 0.0, 0.0]], ref=ref))
    logr = _t(ref) - _t(curr)
    kl = (-logr if kind == "k1" else logr.square() / 2).mean()
    _close(loss, 0.1 * kl)
    assert m["kl_penalty"] == pytest.approx(float(kl), rel=REL)


@pytest.mark.parametrize("on_policy_kl", [False, True], ids=["plain", "on_policy_kl_approximation"])
def test_kl_gradient_includes_sampling_term(on_policy_kl):
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_kl_gradient_includes_sampling_term: the
    KL term carries the score-function weight (exp(lp - lp.detach()), or with the on-policy
    approximation exp(lp - gen), NOT detached), so d(KL loss)/dlp = beta * w * (kl + dkl/dlp) / n."""
    curr, prev, gen, ref, adv = [[-1.2, -0.7]], [[-1.0, -0.8]], [[-1.5, -0.4]], [[-0.9, -1.1]], [[0.4, -0.2]]
    beta = 0.3

    def grad(penalty):
        loss_fn = ClippedPGLoss(reference_policy_kl_penalty=penalty, use_on_policy_kl_approximation=on_policy_kl)
        loss, _, leaf = _run(loss_fn, curr, _pg_batch(adv, prev=prev, gen=gen, ref=ref))
        return _grad(loss, leaf)

    c = _t(curr)
    logr = _t(ref) - c
    weight = torch.exp(c - _t(gen)) if on_policy_kl else torch.ones_like(c)
    expected = beta * weight * (_k3(logr) + (1 - torch.exp(logr))) / c.numel()
    _close(grad(beta) - grad(0.0), expected)


def test_use_kl_in_reward_drops_the_kl_loss():
    """NeMo RL implementation, loss_functions.py ClippedPGLossFn.__init__: with use_kl_in_reward the
    loss's KL penalty is 0 (Reinforce++ puts it in the reward instead)."""
    curr, ref = [[0.0, -1.0, -2.0]], [[-1.0, -1.0, -1.0]]
    batch = _pg_batch(ADV, prev=[[0.0, -1.0, -2.0]], ref=ref)
    loss, m, _ = _run(ClippedPGLoss(reference_policy_kl_penalty=0.1, use_kl_in_reward=True), curr, batch)
    plain, _, _ = _run(ClippedPGLoss(), curr, batch)
    _close(loss, plain)
    assert m["kl_penalty"] == 0


# -------------------------------------------------------------------------------- masking


def _random_pg_case(seed=0, B=2, S=4, V=8):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S - 1, V, generator=g, dtype=F64)
    targets = torch.randint(0, V, (B, S - 1), generator=g)
    curr = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    prev = torch.randn(B, S - 1, generator=g, dtype=F64) * 0.1
    ref = torch.randn(B, S - 1, generator=g, dtype=F64) * 0.1
    adv = torch.randn(B, S - 1, generator=g, dtype=F64) + 1.0
    return curr, prev, ref, adv


def _direct_ppo_k3(curr, prev, ref, adv, mask, beta, tokens):
    """Token-level PPO + beta * k3 KL (NeMo RL's default clamps: log-ratio to +-20, estimate to
    +-10), summed over ``mask`` and divided by ``tokens``."""
    kl = _k3((ref - curr).clamp(-20, 20)).clamp(-10, 10)
    per_token = _ppo_token_loss(curr, prev, adv) + beta * kl
    return (per_token * mask).sum() / tokens


def test_masking_token_mask():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_masking (token_mask part): masking one
    more token changes the loss; both values match the direct formula."""
    curr, prev, ref, adv = _random_pg_case()
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.1)
    default, _, _ = _run(loss_fn, curr, _pg_batch(adv, prev=prev, ref=ref))
    tm = torch.ones(2, 3)
    tm[0, 0] = 0  # NeMo RL's data token_mask[0, 1] = 0
    masked, _, _ = _run(loss_fn, curr, _pg_batch(adv, prev=prev, ref=ref, token_mask=tm))
    assert not torch.isclose(default, masked, atol=1e-4)
    _close(default, _direct_ppo_k3(curr, prev, ref, adv, torch.ones(2, 3, dtype=F64), 0.1, 6))
    _close(masked, _direct_ppo_k3(curr, prev, ref, adv, tm.double(), 0.1, 5))


def test_masking_sample_mask():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_masking (sample_mask part): sample_mask
    [1, 0] gives exactly the loss of a batch holding only sample 0."""
    curr, prev, ref, adv = _random_pg_case()
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.1)
    masked, _, _ = _run(loss_fn, curr, _pg_batch(adv, prev=prev, ref=ref, sample_mask=[1, 0]))
    only_first, _, _ = _run(loss_fn, curr[:1], _pg_batch(adv[:1], prev=prev[:1], ref=ref[:1]))
    _close(masked, only_first)


def test_zero_mask():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_zero_mask: no valid token -> loss exactly 0."""
    curr, prev, ref, adv = _random_pg_case(B=1)
    batch = _pg_batch(adv, prev=prev, ref=ref, token_mask=torch.zeros(1, 3))
    loss, _, leaf = _run(ClippedPGLoss(reference_policy_kl_penalty=0.1), curr, batch)
    assert float(loss) == 0.0
    assert torch.equal(_grad(loss, leaf), torch.zeros(1, 3, dtype=F64))


# ----------------------------------------------------------------------- importance sampling


def test_on_policy_kl_with_importance_sampling():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_on_policy_kl_importance_sampling. Its
    config sets reference_policy_kl_penalty=0.0, so the expected total is the IS-weighted actor
    loss alone (-0.2065)."""
    loss_fn = ClippedPGLoss(use_on_policy_kl_approximation=True, use_importance_sampling_correction=True)
    loss, _, _ = _run(loss_fn, CURR, _pg_batch(ADV, prev=PREV, gen=GEN, ref=REF))
    c, p, a, g = _t(CURR), _t(PREV), _t(ADV), _t(GEN)
    _close(loss, (torch.exp(p - g) * _ppo_token_loss(c, p, a)).mean())
    assert float(loss) == pytest.approx(-0.2065, rel=1e-3)


def test_on_policy_kl_with_importance_sampling_and_penalty():
    """Variant of NeMo RL test_loss_functions.py::test_clipped_pg_loss_on_policy_kl_importance_sampling
    with beta 0.1, the value its hand calculation spells out (-0.2065 + 0.1 * 0.060543), and its
    gradient: the KL weight exp(lp - gen) is not detached (loss_functions.py)."""
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True,
                            use_importance_sampling_correction=True)
    loss, m, leaf = _run(loss_fn, CURR, _pg_batch(ADV, prev=PREV, gen=GEN, ref=REF))
    p, a, g, ref = _t(PREV), _t(ADV), _t(GEN), _t(REF)

    def direct(c):
        actor = (torch.exp(p - g) * _ppo_token_loss(c, p, a)).mean()
        return actor + 0.1 * (torch.exp(c - g) * _k3(ref - c)).mean()

    _close(loss, direct(_t(CURR)))
    assert float(loss) == pytest.approx(-0.2065 + 0.0060543, rel=1e-3)
    assert m["kl_penalty"] == pytest.approx(0.060543, rel=1e-3)
    _close(_grad(loss, leaf), _autograd(direct, CURR))


@pytest.mark.parametrize("sequence_level", [True, False], ids=["sequence", "token"])
def test_truncated_importance_sampling(sequence_level):
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_on_policy_truncated_importance_sampling:
    "tis" at 0.8. Sequence level (GSPO): ratio exp(mean log-ratio) = 0.9086, IS weight
    exp(SUM of prev - gen) = 0.8187 -> 0.8, loss -0.4846; token level: -0.4744."""
    extra = {"sequence_level_importance_ratios": True, "token_level_loss": False} if sequence_level else {}
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                            truncated_importance_sampling_ratio=0.8, **extra)
    loss, _, _ = _run(loss_fn, CURR, _pg_batch(ADV, prev=PREV, gen=GEN, ref=REF))
    c, p, a, g = _t(CURR), _t(PREV), _t(ADV), _t(GEN)
    if sequence_level:
        ratio = torch.exp((c - p).mean()).expand_as(c)
        weights = torch.exp((p - g).sum()).clamp(max=0.8)
    else:
        ratio = torch.exp(c - p)
        weights = torch.exp(p - g).clamp(max=0.8)
    per_token = weights * torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    _close(loss, per_token.mean())
    assert float(loss) == pytest.approx(-0.4846 if sequence_level else -0.4744, rel=1e-3)


def test_icepop():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_icepop_importance_sampling: weights
    outside [0.5, 5] are zeroed (12.18 on token 1); is_oob_ratio 1/3 (loss_functions.py)."""
    gen = [[-0.5, -3.5, -0.8]]
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                            truncated_importance_sampling_ratio=5.0, truncated_importance_sampling_ratio_min=0.5)
    loss, m, _ = _run(loss_fn, PREV, _pg_batch(ADV, prev=PREV, gen=gen))
    w = torch.exp(_t(PREV) - _t(gen))
    w = torch.where((w >= 0.5) & (w <= 5.0), w, torch.zeros_like(w))
    _close(loss, (w * -_t(ADV)).mean())
    assert m["is_oob_ratio"] == pytest.approx(1 / 3, rel=REL)


def test_tis_reports_is_oob_ratio():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_reports_is_oob_ratio_tis: weights
    [1, 3, 0.5] against max 2 -> 1/3 out of bounds."""
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                            truncated_importance_sampling_ratio=2.0)
    prev = torch.log(torch.tensor([[1.0, 3.0, 0.5]], dtype=F64))
    _, m, _ = _run(loss_fn, [[0.0, 0.0, 0.0]], _pg_batch([[1.0, 1.0, 1.0]], prev=prev, gen=[[0.0, 0.0, 0.0]]))
    assert m["is_oob_ratio"] == pytest.approx(1 / 3, rel=REL)


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_tis_rejects_min_above_max(kind):
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_rejects_tis_min_above_max."""
    with pytest.raises(ValueError, match="truncated_importance_sampling_ratio_min"):
        ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_type=kind,
                      truncated_importance_sampling_ratio=1.0, truncated_importance_sampling_ratio_min=2.0)


@pytest.mark.parametrize("tis_min,weights,oob", [(None, [0.1, 1.0, 2.0], 1 / 3), (0.5, [0.5, 1.0, 2.0], 2 / 3)],
                         ids=["min_default_0", "min_0.5"])
def test_tis_min_bound_defaults_to_zero(tis_min, weights, oob):
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_tis_min_bound_defaults_to_zero: on-policy
    ratio, IS weights exp(lp - gen) = [0.1, 1, 3] clamped to [min or 0, 2]; loss -mean(weights)."""
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True, force_on_policy_ratio=True,
                            truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0,
                            truncated_importance_sampling_ratio_min=tis_min)
    curr = torch.log(torch.tensor([[0.1, 1.0, 3.0]], dtype=F64))
    loss, m, _ = _run(loss_fn, curr, _pg_batch([[1.0, 1.0, 1.0]], gen=[[0.0, 0.0, 0.0]]))
    _close(loss, -torch.tensor(weights, dtype=F64).mean())
    assert m["is_oob_ratio"] == pytest.approx(oob, rel=REL)


def test_seq_mask_tis():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_seq_mask_tis: geometric-mean IS ratio
    exp(0.0005) lies in [0.999, 1.002], so the sequence keeps its raw token weights; a -inf
    generation logprob must leave the loss finite (nan_to_num: that token's weight and log-ratio
    become 0, the geometric mean exp(0.001 / 3) stays in bounds)."""
    gen = [[-1.0005, -1.0005, -1.0005]]
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-mask-tis",
                            truncated_importance_sampling_ratio=1.002, truncated_importance_sampling_ratio_min=0.999)
    loss, m, _ = _run(loss_fn, PREV, _pg_batch(ADV, prev=PREV, gen=gen))
    w = torch.exp(_t(PREV) - _t(gen))
    _close(loss, (w * -_t(ADV)).mean())
    assert m["is_oob_ratio"] == 0

    gen_inf = [[-1.0005, float("-inf"), -1.0005]]  # NeMo RL's data["generation_logprobs"][0, 2]
    loss, _, _ = _run(loss_fn, PREV, _pg_batch(ADV, prev=PREV, gen=gen_inf))
    assert torch.isfinite(loss)
    w = torch.tensor([[math.exp(0.0005), 0.0, math.exp(0.0005)]], dtype=F64)
    _close(loss, (w * -_t(ADV)).mean())


def test_seq_mask_tis_drops_whole_sequences():
    """NeMo RL implementation, loss_functions.py ClippedPGLossFn (seq-mask-tis): a sequence whose
    geometric-mean IS ratio leaves [min, max] loses every token's weight; is_oob_ratio counts
    sequences, normalised by global_valid_seqs even under a token-level loss."""
    prev = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
    gen = [[-1.0, -1.1, -0.9], [-1.5, -1.5, -1.5]]  # geometric means exp(0) = 1 and exp(0.5) = 1.65
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-mask-tis",
                            truncated_importance_sampling_ratio=1.5, truncated_importance_sampling_ratio_min=0.5)
    adv = [[1.0, -1.0, 2.0], [3.0, 3.0, 3.0]]
    loss, m, _ = _run(loss_fn, prev, _pg_batch(adv, prev=prev, gen=gen))
    w = torch.exp(_t(prev) - _t(gen)) * torch.tensor([[1.0], [0.0]], dtype=F64)
    _close(loss, (w * -_t(adv)).sum() / 6)
    assert m["is_oob_ratio"] == pytest.approx(1 / 2, rel=REL)


# --------------------------------------------------------------------------------------- GSPO


def _gspo_direct(c, p, a, mask=None, weights=None):
    """Sequence-level loss with GSPO ratios: per row r = exp(mean over valid tokens of lp - prev),
    per-token max(-A r, -A clip(r)), averaged per sequence then over sequences."""
    mask = torch.ones_like(c) if mask is None else mask
    s = torch.exp(((c - p) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True))
    per_token = torch.maximum(-a * s, -a * s.clamp(0.8, 1.2))
    if weights is not None:
        per_token = weights * per_token
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()


GSPO = {"sequence_level_importance_ratios": True, "token_level_loss": False}


def test_gspo():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_gspo: ratio 0.9086 on every token,
    loss -0.6057; gradient by autograd on the direct formula."""
    loss, _, leaf = _run(ClippedPGLoss(**GSPO), CURR, _pg_batch(ADV, prev=PREV))
    p, a = _t(PREV), _t(ADV)
    _close(loss, _gspo_direct(_t(CURR), p, a))
    assert float(loss) == pytest.approx(-0.6057, rel=1e-3)
    _close(_grad(loss, leaf), _autograd(lambda c: _gspo_direct(c, p, a), CURR))


def test_gspo_batch_size_2():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_gspo_batch_size_2: ratios 0.9086 and
    2.4697 (clipped to 1.2), loss -0.4912."""
    adv, prev, curr = ADV * 2, [[-1.0] * 3, [-2.0] * 3], CURR * 2
    loss, _, _ = _run(ClippedPGLoss(**GSPO), curr, _pg_batch(adv, prev=prev))
    _close(loss, _gspo_direct(_t(curr), _t(prev), _t(adv)))
    assert float(loss) == pytest.approx(-0.4912, rel=1e-3)


def test_gspo_importance_sampling_correction():
    """NeMo RL test_loss_functions.py::test_clipped_pg_loss_gspo_importance_sampling_correction:
    one weight per sequence, exp(sum(prev - gen)) = 0.8187, loss -0.4959."""
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True, **GSPO)
    loss, m, _ = _run(loss_fn, CURR, _pg_batch(ADV, prev=PREV, gen=GEN, ref=REF))
    weight = torch.exp((_t(PREV) - _t(GEN)).sum())
    _close(loss, _gspo_direct(_t(CURR), _t(PREV), _t(ADV), weights=weight))
    assert float(loss) == pytest.approx(-0.4959, rel=1e-3)
    # sampling_importance_ratio: mean over sequences of the sequence weight (loss_functions.py)
    assert m["sampling_importance_ratio"] == pytest.approx(float(weight), rel=REL)


def test_gspo_ratio_averages_valid_tokens_only():
    """NeMo RL implementation, loss_functions.py ClippedPGLossFn (GSPO): the sequence's log-ratio is
    the masked mean over token_mask, and the IS weight sums prev - gen over valid tokens only."""
    tm = torch.tensor([[1.0, 1.0, 0.0]])
    prev, curr = [[-1.0, -1.0, -1.0]], [[-1.2, -0.9, -5.0]]
    gen = [[-1.1, -0.95, -9.0]]
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True, **GSPO)
    loss, _, leaf = _run(loss_fn, curr, _pg_batch(ADV, prev=prev, gen=gen, token_mask=tm))
    p, a, m = _t(prev), _t(ADV), tm.double()
    weight = torch.exp(((p - _t(gen)) * m).sum())
    direct = lambda c: _gspo_direct(c, p, a, mask=m, weights=weight)  # noqa: E731
    _close(loss, direct(_t(curr)))
    _close(_grad(loss, leaf), _autograd(direct, curr))


# ------------------------------------------------------------- token- vs sequence-level loss


def test_token_versus_sequence_level_loss():
    """NeMo RL implementation, loss_functions.py ClippedPGLossFn: token level = masked sum over the
    global valid tokens; sequence level = per-sequence mean over token_mask, then the sum over
    sample_mask divided by global_valid_seqs. A sequence with sample_mask 1 and no valid token
    adds 0 but still counts among the sequences (as global_valid_seqs = sum(sample_mask))."""
    curr = [[-1.0, -1.0, -1.0]] * 3
    adv = [[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [7.0, 7.0, 7.0]]
    tm = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    batch = _pg_batch(adv, prev=curr, token_mask=tm)
    assert _nemo_counts(batch) == (5.0, 3.0)
    token, _, _ = _run(ClippedPGLoss(), curr, batch)
    seq, _, _ = _run(ClippedPGLoss(token_level_loss=False), curr, batch)
    _close(token, -(1 + 2 + 5 + 5 + 5) / 5)
    _close(seq, -((1 + 2) / 2 + 5) / 3)


# --------------------------------------------------------------------------- diagnostic metrics


@pytest.mark.parametrize("kind", ["k3", "k1"])
def test_diagnostic_metrics(kind):
    """NeMo RL implementation, loss_functions.py ClippedPGLossFn.__call__ metrics (all means over
    the valid tokens, sample_mask applied): token_mult_prob_error = exp|gen - prev|;
    gen_kl_error = calculate_kl(gen, ref=prev) and policy_kl_error = calculate_kl(prev, ref=gen),
    both unclamped with reference_policy_kl_type; js_divergence_error against the mixture;
    sampling_importance_ratio = exp(prev - gen) (reported even without IS correction);
    approx_entropy; probs_ratio(_clamped); num_valid_samples = sum(sample_mask)."""
    curr = [[-0.5, -1.0, -2.0], [-0.1, -0.1, -0.1]]
    prev = [[-0.7, -0.8, -2.5], [-3.0, -3.0, -3.0]]
    gen = [[-0.6, -1.3, -2.0], [-0.2, -0.2, -0.2]]
    tm = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    batch = _pg_batch(ADV * 2, prev=prev, gen=gen, token_mask=tm, sample_mask=[1, 0])
    _, m, _ = _run(ClippedPGLoss(reference_policy_kl_type=kind), curr, batch)
    c, p, g = _t(curr)[:1], _t(prev)[:1], _t(gen)[:1]  # the second sequence is sample-masked

    def est(logr):
        return -logr if kind == "k1" else _k3(logr)

    log_mix = torch.log(0.5 * torch.exp(p) + 0.5 * torch.exp(g))
    r = torch.exp(c - p)
    expected = {
        "token_mult_prob_error": torch.exp((g - p).abs()).mean(),
        "gen_kl_error": est(p - g).mean(),
        "policy_kl_error": est(g - p).mean(),
        "js_divergence_error": (0.5 * _k3(p - log_mix) + 0.5 * _k3(g - log_mix)).mean(),
        "sampling_importance_ratio": torch.exp(p - g).mean(),
        "approx_entropy": -(torch.exp(c - g) * c).mean(),
        "probs_ratio": r.mean(),
        "probs_ratio_clamped": r.clamp(0.8, 1.2).mean(),
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(float(value), rel=REL), key
    assert m["num_valid_samples"] == 1
    assert m["kl_penalty"] == 0
    assert "is_oob_ratio" not in m


# ---------------------------------------------------------------- metric normalisation (split)


NORMALISATION_CONFIGS = {
    # TestMetricNormalizationAdvertisement::test_default_grpo_config (NeMo RL's default beta 0.01)
    "default": dict(reference_policy_kl_penalty=0.01),
    # ::test_gspo_config_keys_on_sequence_flags
    "gspo": dict(reference_policy_kl_penalty=0.01, token_level_loss=False, sequence_level_importance_ratios=True,
                 use_importance_sampling_correction=True),
    # ::test_seq_mask_tis_with_token_level_loss and test_split_rescale_matches_sync_normalization
    "seq_mask_tis_token_loss": dict(reference_policy_kl_penalty=0.01, token_level_loss=True,
                                    use_importance_sampling_correction=True,
                                    truncated_importance_sampling_type="seq-mask-tis",
                                    truncated_importance_sampling_ratio=1.5,
                                    truncated_importance_sampling_ratio_min=0.7),
    # ::test_tis_under_sequence_level_loss_stays_tokens
    "tis_sequence_loss": dict(reference_policy_kl_penalty=0.01, token_level_loss=False,
                              use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                              truncated_importance_sampling_ratio=2.0),
}


def _normalisers(cfg) -> dict[str, str]:
    """NeMo RL's metric_normalizations table (loss_functions.py ClippedPGLossFn.__init__)."""
    grad = "tokens" if cfg.get("token_level_loss", True) else "seqs"
    table = {"loss": grad, "kl_penalty": grad, "pg_loss": grad}
    for key in ("probs_ratio", "probs_ratio_clamped", "token_mult_prob_error", "gen_kl_error",
                "policy_kl_error", "js_divergence_error", "approx_entropy"):
        table[key] = "tokens"
    table["sampling_importance_ratio"] = "seqs" if cfg.get("sequence_level_importance_ratios") else "tokens"
    if cfg.get("truncated_importance_sampling_type"):
        table["is_oob_ratio"] = "seqs" if cfg["truncated_importance_sampling_type"] == "seq-mask-tis" else "tokens"
    return table


@pytest.mark.parametrize("name", list(NORMALISATION_CONFIGS))
def test_metric_normalisation_split_rescale(name):
    """NeMo RL test_loss_functions.py::TestMetricNormalizationAdvertisement (the four configs) and
    ::test_split_rescale_matches_sync_normalization: every metric is the micro-batch's share of the
    global value, normalised by NeMo RL's advertised denominator (tokens or sequences, keyed on
    the flags as in NeMo RL, e.g. is_oob_ratio by sequences for seq-mask-tis under a token-level
    loss). Calling with placeholder counts 1 and dividing the summed raw values by the right global
    count must equal the sum of the truly normalised values; and that sum must equal one call on
    the whole batch. num_valid_samples is a raw count."""
    cfg = NORMALISATION_CONFIGS[name]
    loss_fn = ClippedPGLoss(**cfg)
    g = torch.Generator().manual_seed(1234)
    micro = []
    for _ in range(2):
        B, T = 4, 7
        adv = torch.randn(B, T, generator=g, dtype=F64)
        prev = -torch.rand(B, T, generator=g, dtype=F64)
        # per-row offsets put some sequences' geometric-mean IS ratio out of bounds
        gen = prev - torch.tensor([[0.0], [0.8], [-0.5], [0.1]], dtype=F64) - 0.05 * torch.rand(B, T, generator=g)
        ref = -torch.rand(B, T, generator=g, dtype=F64)
        curr = -torch.rand(B, T, generator=g, dtype=F64)
        tm = torch.ones(B, T)
        tm[0, -2:] = 0
        micro.append((curr, _pg_batch(adv, prev=prev, gen=gen, ref=ref, token_mask=tm, sample_mask=[1, 1, 1, 0])))
    tokens = sum(_nemo_counts(b)[0] for _, b in micro)
    seqs = sum(_nemo_counts(b)[1] for _, b in micro)
    assert (tokens, seqs) == (38.0, 6.0)

    sync, raw = {}, {}
    for curr, batch in micro:
        _, m_sync, _ = _run(loss_fn, curr, batch, counts=(tokens, seqs))
        _, m_raw, _ = _run(loss_fn, curr, batch, counts=(1.0, 1.0))
        for key in m_sync:
            sync[key] = sync.get(key, 0.0) + m_sync[key]
            raw[key] = raw.get(key, 0.0) + m_raw[key]
    table = _normalisers(cfg)
    if "is_oob_ratio" not in table:
        assert "is_oob_ratio" not in sync
    for key, kind in table.items():
        denom = tokens if kind == "tokens" else seqs
        assert raw[key] / denom == pytest.approx(sync[key], rel=1e-9, abs=1e-12), f"{key} ({kind})"
    assert raw["num_valid_samples"] == sync["num_valid_samples"] == seqs

    whole = TokenBatch(
        input_ids=torch.cat([b.input_ids for _, b in micro]),
        input_lengths=torch.cat([b.input_lengths for _, b in micro]),
        fields={k: torch.cat([b.fields[k] for _, b in micro]) for k in micro[0][1].fields},
    )
    _, m_whole, _ = _run(loss_fn, torch.cat([c for c, _ in micro]), whole, counts=(tokens, seqs))
    for key in table:
        assert m_whole[key] == pytest.approx(sync[key], rel=1e-9, abs=1e-12), key


# ------------------------------------------------------------------------- invalid configs


@pytest.mark.parametrize(
    "cfg",
    [
        {"sequence_level_importance_ratios": True, "token_level_loss": True},
        {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "bogus",
         "truncated_importance_sampling_ratio": 2.0},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis"},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
         "truncated_importance_sampling_ratio": 0.0},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
         "truncated_importance_sampling_ratio": 5.0},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
         "truncated_importance_sampling_ratio": 1.5, "truncated_importance_sampling_ratio_min": 0.5,
         "sequence_level_importance_ratios": True, "token_level_loss": False},
        {"use_cispo": True, "token_level_loss": False},
    ],
    ids=["gspo_with_token_loss", "tis_without_is_correction", "unknown_tis_type", "tis_without_ratio",
         "tis_ratio_not_positive", "icepop_without_min", "seq_mask_tis_with_gspo", "cispo_sequence_loss"],
)
def test_invalid_config_rejected(cfg):
    """NeMo RL implementation, loss_functions.py ClippedPGLossFn.__init__ assertions (nrl: ValueError)."""
    with pytest.raises(ValueError):
        ClippedPGLoss(**cfg)


def test_truncation_ratio_without_type_is_tis():
    """NeMo RL implementation, loss_functions.py ClippedPGLossFn.__call__: a
    truncated_importance_sampling_ratio with no truncated_importance_sampling_type raises
    ValueError there. nrl keeps its earlier meaning, plain tis (clamp to [0, ratio]), so its own
    configs keep working (docs/configuration.md); a NeMo RL config never has this combination."""
    plain = ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0)
    typed = ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0,
                          truncated_importance_sampling_type="tis")
    batch = _pg_batch(ADV, prev=PREV, gen=GEN)
    (a, ma, _), (b, mb, _) = _run(plain, CURR, batch), _run(typed, CURR, batch)
    assert float(a) == float(b) and ma == mb


# ------------------------------------------------------------------------------ loss counts


def test_loss_counts_nemo_semantics():
    """NeMo RL's normalisers as every test_loss_functions.py case passes them (e.g.
    test_clipped_pg_loss_zero_mask: one sequence with no valid token still counts):
    tokens = sum(token_mask * sample_mask), sequences = sum(sample_mask)."""
    tm = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    batch = _pg_batch([[0.0] * 3] * 3, token_mask=tm, sample_mask=[1, 1, 0])
    assert batch.loss_counts() == (2.0, 2.0)
    assert batch.loss_counts() == _nemo_counts(batch)


# ---------------------------------------------------------------------------------------- NLL


def _nll_batch(token_mask, sample_mask=None) -> TokenBatch:
    tm = torch.as_tensor(token_mask, dtype=torch.float32)
    fields = {"token_mask": tm}
    if sample_mask is not None:
        fields["sample_mask"] = torch.as_tensor(sample_mask, dtype=torch.float32)
    return TokenBatch(input_ids=torch.zeros(tm.shape, dtype=torch.long),
                      input_lengths=torch.full((tm.shape[0],), tm.shape[1]), fields=fields)


@pytest.mark.parametrize("correct", [True, False], ids=["correct", "incorrect"])
def test_nll_loss(correct):
    """NeMo RL test_loss_functions.py::test_nll_loss: input_ids [0, 1, 2, 3], token_mask
    [0, 0, 1, 1]; logits predicting the next token with logit 999 give loss 0, predicting the
    token before it give 999 per token; 2 tokens counted."""
    ids = torch.arange(4)
    logits = torch.zeros(3, 8, dtype=F64)  # next-token logits of positions 0..2
    for i in range(3):
        logits[i, ids[i + 1] if correct else ids[i]] = 999.0
    next_lp = torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
    logprobs = torch.cat([torch.zeros(1, dtype=F64), next_lp])[None]
    batch = _nll_batch([[0, 0, 1, 1]], sample_mask=[1])
    loss, m = NLLLoss()(logprobs, batch, global_valid_tokens=2.0, global_valid_seqs=1.0)
    assert float(loss) == pytest.approx(0.0 if correct else 999.0, abs=1e-9)
    assert m["num_valid_tokens"] == 2


def test_nll_loss_honours_sample_mask():
    """NeMo RL implementation, loss_functions.py NLLLossFn: mask = token_mask * sample_mask, and
    num_unmasked_tokens (nrl: num_valid_tokens) counts that mask."""
    logprobs = _t([[0.0, -1.0, -2.0], [0.0, -5.0, -7.0]])
    batch = _nll_batch([[0, 1, 1], [0, 1, 1]], sample_mask=[1, 0])
    loss, m = NLLLoss()(logprobs, batch, global_valid_tokens=2.0, global_valid_seqs=1.0)
    _close(loss, (1.0 + 2.0) / 2)
    assert m["num_valid_tokens"] == 2


# ---------------------------------------------------------------------------------------- DPO


def _dpo_batch(token_mask, reference=None) -> TokenBatch:
    tm = torch.as_tensor(token_mask, dtype=torch.float32)
    B = tm.shape[0]
    fields = {
        "token_mask": tm,
        "reference_logprobs": torch.zeros(tm.shape, dtype=F64) if reference is None else reference,
        "sample_mask": torch.ones(B),
        "chosen": torch.tensor([1 - i % 2 for i in range(B)]),
        "pair": torch.arange(B) // 2,
    }
    return TokenBatch(input_ids=torch.zeros(tm.shape, dtype=torch.long), input_lengths=torch.full((B,), tm.shape[1]),
                      fields=fields)


def _dpo_call(loss_fn, logprobs, batch):
    tm, sm = batch.fields["token_mask"].double(), batch.fields["sample_mask"].double()
    return loss_fn(logprobs, batch, global_valid_tokens=float((tm * sm[:, None]).sum()),
                   global_valid_seqs=float(sm.sum()))


def test_dpo_loss():
    """NeMo RL test_loss_functions.py::test_dpo_loss: zero logits over 16 tokens, 2 response tokens
    per sequence, zero reference: equal rewards -> preference loss log 2; with sft_loss_weight 0.5
    the loss adds 0.5 * 2 * log 16."""
    logprobs = torch.full((2, 4), -math.log(16), dtype=F64)
    batch = _dpo_batch([[0, 0, 1, 1], [0, 0, 1, 1]])
    loss, _ = _dpo_call(DPOLoss(reference_policy_kl_penalty=0.0), logprobs, batch)
    _close(loss, math.log(2))
    loss, _ = _dpo_call(DPOLoss(reference_policy_kl_penalty=0.0, sft_loss_weight=0.5), logprobs, batch)
    _close(loss, 0.5 * 2 * math.log(16) + math.log(2))


def test_dpo_loss_varying_sequence_lengths():
    """NeMo RL test_loss_functions.py::test_dpo_loss_varying_sequence_lengths: lengths 3, 5, 4, 6
    (2, 4, 3, 5 predicted tokens), zero logits over 10 tokens: sft_loss is the chosen sequences'
    summed NLL averaged over pairs (2.5 log 10), or with averaging the per-token mean (log 10).
    The preference loss (not checked by NeMo RL) follows from rewards -2 log 10 vs -4 log 10 (sum)."""
    tm = torch.zeros(4, 6)
    for row, length in enumerate([3, 5, 4, 6]):
        tm[row, 1:length] = 1  # NeMo RL's token_mask[row, :length] = 1, sliced [:, 1:]
    logprobs = torch.full((4, 6), -math.log(10), dtype=F64)
    batch = _dpo_batch(tm)
    cfg = dict(reference_policy_kl_penalty=0.1, sft_loss_weight=0.5)
    _, m = _dpo_call(DPOLoss(**cfg), logprobs, batch)
    _, m_avg = _dpo_call(DPOLoss(preference_average_log_probs=True, sft_average_log_probs=True, **cfg),
                         logprobs, batch)
    log10 = math.log(10)
    assert m["sft_loss"] == pytest.approx((2 + 3) * log10 / 2, rel=REL)
    assert m_avg["sft_loss"] == pytest.approx(log10, rel=REL)
    pref = [-math.log(1 / (1 + math.exp(-0.1 * (-2 * log10 + 4 * log10)))),
            -math.log(1 / (1 + math.exp(-0.1 * (-3 * log10 + 5 * log10))))]
    assert m["preference_loss"] == pytest.approx(sum(pref) / 2, rel=REL)
    assert m_avg["preference_loss"] == pytest.approx(math.log(2), rel=REL)


def test_dpo_sft_matches_nll_loss():
    """NeMo RL test_loss_functions.py::test_dpo_sft_matches_nll_loss: with preference_loss_weight 0
    and sft_loss_weight 1, DPO's loss * num_pairs / chosen tokens equals the NLL of the chosen
    sequences."""
    g = torch.Generator().manual_seed(0)
    tm = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float32)
    logits = torch.randn(4, 5, 8, generator=g, dtype=F64)
    ids = torch.randint(0, 8, (4, 5), generator=g)
    next_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logprobs = torch.cat([torch.zeros(4, 1, dtype=F64), next_lp], 1)
    tm[:, 0] = 0
    batch = _dpo_batch(tm, reference=torch.randn(4, 5, generator=g, dtype=F64))
    dpo, _ = _dpo_call(DPOLoss(reference_policy_kl_penalty=0.0, preference_loss_weight=0.0, sft_loss_weight=1.0),
                       logprobs, batch)
    chosen_tokens = float(tm[::2].sum())
    nll, _ = NLLLoss()(logprobs[::2], _nll_batch(tm[::2], sample_mask=[1, 1]),
                       global_valid_tokens=chosen_tokens, global_valid_seqs=2.0)
    _close(dpo * 2 / chosen_tokens, nll)
    _close(nll, -(next_lp[::2] * tm[::2, 1:].double()).sum() / chosen_tokens)


# ------------------------------------------------------ calculate_baseline_and_std_per_prompt


def _baseline(rewards, prompts, valid=None, leave_one_out=True):
    r = torch.tensor(rewards, dtype=F64)
    ids = prompt_group_ids(torch.tensor(prompts) if prompts else torch.empty(0, 3, dtype=torch.long))
    mask = None if valid is None else torch.tensor(valid, dtype=F64)
    return baseline_and_std(r, ids, leave_one_out=leave_one_out, valid_mask=mask)


TWO_PROMPTS = [[1, 2, 3]] * 3 + [[4, 5, 6]] * 3
S2 = math.sqrt(2)


def test_baseline_and_std_basic():
    """NeMo RL test_utils.py::test_calculate_baseline_and_std_per_prompt_basic (leave-one-out):
    baselines are the others' means, std the others' unbiased std."""
    b, s = _baseline([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], TWO_PROMPTS)
    _close(b, [2.5, 2.0, 1.5, 5.5, 5.0, 4.5])
    _close(s, [1 / S2, S2, 1 / S2, 1 / S2, S2, 1 / S2])


def test_baseline_and_std_single_generation_per_prompt():
    """NeMo RL test_utils.py::test_calculate_baseline_and_std_per_prompt_single_generation_per_prompt:
    a group of one valid response takes its own reward as baseline, std 0."""
    b, s = _baseline([2.5, 4.0], [[1, 2, 3], [4, 5, 6]])
    _close(b, [2.5, 4.0])
    _close(s, [0.0, 0.0])


def test_baseline_and_std_identical_rewards():
    """NeMo RL test_utils.py::test_calculate_baseline_and_std_per_prompt_identical_rewards."""
    b, s = _baseline([3.0, 3.0, 3.0, 7.0, 7.0, 7.0], TWO_PROMPTS)
    _close(b, [3.0, 3.0, 3.0, 7.0, 7.0, 7.0])
    _close(s, [0.0] * 6)


def test_baseline_and_std_mixed_prompt_sizes():
    """NeMo RL test_utils.py::test_calculate_baseline_and_std_per_prompt_mixed_prompt_sizes: with
    leave-one-out a group of two has one other reward and std 0."""
    b, s = _baseline([1.0, 2.0, 4.0, 5.0, 6.0], [[1, 2, 3]] * 2 + [[4, 5, 6]] * 3)
    _close(b, [2.0, 1.0, 5.5, 5.0, 4.5])
    _close(s, [0.0, 0.0, 1 / S2, S2, 1 / S2])


def test_baseline_and_std_empty_input():
    """NeMo RL test_utils.py::test_calculate_baseline_and_std_per_prompt_empty_input."""
    b, s = _baseline([], [])
    assert b.shape == s.shape == torch.Size([0])


def test_baseline_and_std_valid_mask():
    """NeMo RL test_utils.py::test_calculate_baseline_and_std_per_prompt_nan_handling: the invalid
    999 is left out of every baseline, so the valid members get 3 and 1 and group 0's valid std is
    0 (one other valid reward). For the invalid member itself NeMo RL divides the valid sum by
    (valid count - 1), a value no loss reads; nrl gives it its own reward and std 0 (advantage 0)."""
    b, s = _baseline([1.0, 999.0, 3.0, 4.0, 5.0, 6.0], TWO_PROMPTS, valid=[1, 0, 1, 1, 1, 1])
    _close(b, [3.0, 999.0, 1.0, 5.5, 5.0, 4.5])
    _close(s, [0.0, 0.0, 0.0, 1 / S2, S2, 1 / S2])


def test_baseline_and_std_two_prompts_of_two():
    """NeMo RL test_utils.py::test_calculate_baseline_and_std_per_prompt_cuda_compatibility (its
    values, on the CPU)."""
    b, s = _baseline([1.0, 2.0, 3.0, 4.0], [[1, 2, 3]] * 2 + [[4, 5, 6]] * 2)
    _close(b, [2.0, 1.0, 4.0, 3.0])
    _close(s, [0.0] * 4)


def test_baseline_and_std_numerical_precision():
    """NeMo RL test_utils.py::test_calculate_baseline_and_std_per_prompt_numerical_precision."""
    b, s = _baseline([1e-8, 2e-8, 3e-8, 1e8, 2e8, 3e8], TWO_PROMPTS)
    _close(b, [2.5e-8, 2e-8, 1.5e-8, 2.5e8, 2e8, 1.5e8], rel=1e-5, abs_=0)
    assert torch.isfinite(s).all()


def test_baseline_groups_by_prompt_content_not_position():
    """NeMo RL implementation, utils.py calculate_baseline_and_std_per_prompt: groups are the
    unique prompt rows (torch.unique(prompts, dim=0)) wherever they sit in the batch."""
    prompts = [[4, 5, 6], [1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6], [1, 2, 3]]
    assert prompt_group_ids(torch.tensor(prompts)).tolist() == [0, 1, 0, 1, 0, 1]
    assert prompt_group_ids(prompts).tolist() == [0, 1, 0, 1, 0, 1]
    b, s = _baseline([4.0, 1.0, 5.0, 2.0, 6.0, 3.0], prompts)
    _close(b, [5.5, 2.5, 5.0, 2.0, 4.5, 1.5])
    _close(s, [1 / S2, 1 / S2, S2, S2, 1 / S2, 1 / S2])


# ------------------------------------------------------------------- GRPOAdvantageEstimator


def _grpo(rewards, prompts, leave_one_out=False, normalize=True):
    r = torch.tensor(rewards, dtype=F64)
    return group_advantages(r, group_ids=prompt_group_ids(torch.tensor(prompts)), leave_one_out=leave_one_out,
                            normalize=normalize)


def test_grpo_advantage_zero_std():
    """NeMo RL test_grpo.py::test_grpo_advantage_estimator_zero_std (no leave-one-out): equal
    rewards stay 0 unnormalised; [1, 3] -> -+1/sqrt(2) (adv / (std + 1e-6))."""
    adv = _grpo([2.0, 2.0, 1.0, 3.0], [[0], [0], [1], [1]])
    _close(adv, [0.0, 0.0, -1 / (S2 + 1e-6), 1 / (S2 + 1e-6)])
    assert adv[2].item() == pytest.approx(-0.7071, rel=1e-4)


def test_grpo_advantage_tensor_shapes():
    """NeMo RL test_grpo.py::test_grpo_advantage_estimator_tensor_shapes: a group of two and a
    group of ten (arange rewards: normalised advantages average to 0)."""
    _close(_grpo([1.0, 3.0], [[0], [0]]), [-1 / (S2 + 1e-6), 1 / (S2 + 1e-6)])
    r = torch.arange(10, dtype=F64)
    adv = _grpo(r.tolist(), [[0]] * 10)
    assert adv.shape == (10,)
    assert abs(float(adv.mean())) < 1e-5
    _close(adv, (r - r.mean()) / (r.std() + 1e-6))


def test_grpo_advantage_negative_advantages():
    """NeMo RL test_grpo.py::test_grpo_advantage_estimator_negative_advantages."""
    adv = _grpo([0.0, 2.0, 4.0], [[0]] * 3)
    assert adv[0] < 0 and abs(float(adv[1])) < 1e-5 and adv[2] > 0
    _close(adv[0], -adv[2])
    _close(adv, [-2 / (2 + 1e-6), 0.0, 2 / (2 + 1e-6)])


def test_grpo_advantage_zero_std_and_zero_advantage():
    """NeMo RL test_grpo.py::test_grpo_advantage_estimator_zero_std_and_zero_advantage."""
    adv = _grpo([5.0] * 4, [[0]] * 4)
    assert adv.tolist() == [0.0] * 4


def test_grpo_advantage_small_nonzero_std():
    """NeMo RL test_grpo.py::test_grpo_advantage_estimator_small_nonzero_std: [1, 1.01] is still
    normalised to about -+1/sqrt(2)."""
    adv = _grpo([1.0, 1.01], [[0], [0]])
    assert abs(float(adv[0])) == pytest.approx(1 / S2, rel=1e-3)
    assert float(adv[0] * adv[1]) < 0


def test_grpo_advantage_tiny_std_has_no_threshold():
    """Variant of NeMo RL test_grpo.py::test_grpo_advantage_estimator_small_nonzero_std ("no
    arbitrary threshold that would skip normalization"; advantage_estimator.py normalises wherever
    std > 0): std 7.07e-8 is below the 1e-6 epsilon yet still divides: adv / (std + 1e-6)."""
    adv = _grpo([0.0, 1e-7], [[0], [0]])
    std = 1e-7 / S2
    _close(adv, [-0.5e-7 / (std + 1e-6), 0.5e-7 / (std + 1e-6)])


def test_grpo_advantage_leave_one_out_normalised():
    """NeMo RL implementation, advantage_estimator.py GRPOAdvantageEstimator with its default
    config (use_leave_one_out_baseline, normalize_rewards): group [1, 0, 0] -> baselines
    [0, .5, .5]; stds of the others [0, 1/sqrt 2, 1/sqrt 2]: the first stays unnormalised."""
    adv = _grpo([1.0, 0.0, 0.0, 0.5, 0.5, 0.5], [[0]] * 3 + [[1]] * 3, leave_one_out=True)
    _close(adv, [1.0, -0.5 / (1 / S2 + 1e-6), -0.5 / (1 / S2 + 1e-6), 0.0, 0.0, 0.0])
    # the same through group_size (consecutive groups), nrl's rollout layout
    by_size = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5], dtype=F64), 3)
    _close(by_size, adv)


def test_grpo_advantage_leave_one_out_pairs_stay_unnormalised():
    """NeMo RL implementation, utils.py calculate_baseline_and_std_per_prompt: with leave-one-out a
    group of two has one other reward, std 0, so GRPO leaves its advantages unnormalised."""
    adv = _grpo([1.0, 3.0, 0.0, 0.0], [[0], [0], [1], [1]], leave_one_out=True)
    _close(adv, [-2.0, 2.0, 0.0, 0.0])


def test_grpo_advantage_unnormalised_mean_baseline():
    """NeMo RL implementation, advantage_estimator.py GRPOAdvantageEstimator with
    normalize_rewards=False and no leave-one-out: reward minus the group mean."""
    adv = _grpo([1.0, 0.0, 0.0, 3.0, 5.0, 7.0], [[0]] * 3 + [[1]] * 3, normalize=False)
    _close(adv, [2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0])


# ------------------------------------------------------------------------------ GDPO and REINFORCE++


def _estimator_inputs(rewards, components=None, width=3):
    from nrl_core.contracts import AdvantageInputs

    n = len(rewards)
    batch = TokenBatch(input_ids=torch.zeros(n, width, dtype=torch.long), input_lengths=torch.full((n,), width),
                       fields={"token_mask": torch.ones(n, width)})
    return AdvantageInputs(rewards=torch.tensor(rewards), group_ids=torch.zeros(n, dtype=torch.long), batch=batch,
                           reward_components={k: torch.tensor(v) for k, v in (components or {}).items()})


def _gdpo(weights=None):
    from nrl_core.algorithms.estimators import MultiRewardEstimator

    section = {"use_leave_one_out_baseline": False, "normalize_rewards": True, "reward_weights": weights}
    return MultiRewardEstimator(section, {"grpo": {}})


def test_gdpo_multiple_rewards():
    """NeMo RL test_grpo.py::test_gdpo_advantage_estimator_multiple_rewards."""
    adv = _gdpo()(_estimator_inputs([0.0, 0.0], {"correctness": [1.0, 1.0], "integer": [1.0, -1.0],
                                                  "format": [1.0, 0.0]}))
    _close(adv, [0.7071, -0.7071], rel=1e-3)


def test_gdpo_single_reward_is_refused():
    """NeMo RL test_grpo.py::test_gdpo_advantage_estimator_single_reward (nrl: a one-line ConfigError)."""
    from nrl_core.errors import ConfigError

    with pytest.raises(ConfigError, match="gdpo needs an environment that reports several named rewards, got 1"):
        _gdpo()(_estimator_inputs([1.0, 3.0], {"correctness": [1.0, 3.0]}))


def test_gdpo_reward_weights():
    """NeMo RL test_grpo.py::test_gdpo_advantage_estimator_reward_weights: uniform scaling changes
    nothing after the final normalisation, non-uniform weights do, a wrong count is refused."""
    from nrl_core.errors import ConfigError

    inputs = _estimator_inputs([0.0] * 3, {"correctness": [1.0, 0.0, 1.0], "format": [1.0, 1.0, 0.0]})
    default = _gdpo()(inputs)
    assert torch.allclose(default, _gdpo([2.0, 2.0])(inputs), atol=1e-5)
    assert not torch.allclose(default, _gdpo([1.0, 0.25])(inputs), atol=1e-3)
    with pytest.raises(ConfigError, match="reward_weights: has 1 entries for 2 rewards"):
        _gdpo([1.0])(inputs)


def test_reinforce_plus_plus_global_normalization():
    """NeMo RL test_grpo.py::test_reinforce_plus_plus_global_normalization."""
    from nrl_core.algorithms.estimators import ReinforcePlusPlusEstimator

    config = {"loss_fn": {"use_kl_in_reward": False, "reference_policy_kl_penalty": 0.0001,
                          "reference_policy_kl_type": "k2"}}
    inputs = _estimator_inputs([0.0, 1.0, 2.0, 3.0], width=5)
    result = ReinforcePlusPlusEstimator({"minus_baseline": True}, config)(inputs)
    assert abs(float(result.mean())) < 1e-5
    assert result[0, 0] < result[1, 0] < result[2, 0] < result[3, 0]
