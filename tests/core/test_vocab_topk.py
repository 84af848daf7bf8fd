"""``nrl_core.sdk.vocab``: the top-k of the next-token distribution and logprobs at given ids, on
whole logits and on logits split over the vocabulary between two gloo ranks. Split and whole agree
within float32 rounding (1e-6): the normaliser is reduced in another order; the top-k ids are equal."""

from __future__ import annotations

import torch

from nrl_core.sdk.vocab import next_token_logprobs_at, next_token_topk
from nrl_core.testing.distributed import run_distributed

B, S, V, K = 3, 7, 16, 4


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, S, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_topk_is_the_shifted_log_softmax_top_k_aligned_to_the_predicted_token():
    logits = _logits()
    values, ids = next_token_topk(logits, K, temperature=0.7)
    expected = (logits[:, :-1] / 0.7).log_softmax(-1).topk(K, dim=-1)
    assert values.shape == ids.shape == (B, S, K)
    assert torch.equal(ids[:, 1:], expected.indices) and torch.allclose(values[:, 1:], expected.values, atol=1e-6)
    assert not values[:, 0].any() and not ids[:, 0].any()  # position 0 predicts nothing


def test_logprobs_at_ids_are_full_vocabulary_logprobs_with_gradients():
    logits = _logits().requires_grad_()
    ids = torch.randint(0, V, (B, S, K), generator=torch.Generator().manual_seed(1))
    out = next_token_logprobs_at(logits, ids)
    expected = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:])
    assert torch.allclose(out[:, 1:], expected, atol=1e-6) and not out[:, 0].any()
    out.sum().backward()
    assert logits.grad is not None and logits.grad[:, -1].abs().sum() == 0  # the last position predicts nothing


def test_padded_vocabulary_entries_are_never_chosen():
    logits = _logits()
    logits[..., V - 2:] = 100.0
    _, ids = next_token_topk(logits, K, vocab_size=V - 2)
    assert int(ids.max()) < V - 2


def _split_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    logits = _logits()
    shard = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
    values, ids = next_token_topk(shard, K, temperature=0.7, tp_group=group)
    target = torch.randint(0, V, (B, S, K), generator=torch.Generator().manual_seed(1))
    gathered = next_token_logprobs_at(shard, target, temperature=0.7, tp_group=group)
    (gathered * torch.arange(K)).sum().backward()
    return {"values": values, "ids": ids, "gathered": gathered.detach(), "grad": shard.grad}


def test_two_vocabulary_shards_give_the_whole_vocabularys_answers():
    ranks = run_distributed(_split_rank, 2)
    logits = _logits().requires_grad_()
    values, ids = next_token_topk(logits, K, temperature=0.7)
    target = torch.randint(0, V, (B, S, K), generator=torch.Generator().manual_seed(1))
    gathered = next_token_logprobs_at(logits, target, temperature=0.7)
    (gathered * torch.arange(K)).sum().backward()
    for rank in ranks:
        assert torch.equal(rank["ids"], ids)
        assert torch.allclose(rank["values"], values, atol=1e-6)
        assert torch.allclose(rank["gathered"], gathered.detach(), atol=1e-6)
    whole = torch.cat([ranks[0]["grad"], ranks[1]["grad"]], dim=-1)
    assert torch.allclose(whole, logits.grad, atol=1e-6)
