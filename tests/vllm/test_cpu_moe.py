"""The pieces behind vLLM expert parallelism on CPU, ungated experts and the per-rank refit read
count, without an engine: the router's global expert ids as one rank's local slots, squared-ReLU
experts against a token-by-token reference, and the counter's attribution of each copy to the
refit tensor it reads from."""

from __future__ import annotations

import pytest
import torch

from nrl_gen_vllm.cpu_moe import (
    local_routing,
    process_experts_on_reload,
    run_ungated_experts,
    translate_expert_ids,
    ungated_experts,
)
from nrl_gen_vllm.refit_reads import RefitReadCounter


def test_global_expert_ids_become_local_slots_and_other_ranks_experts_weigh_nothing() -> None:
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)  # rank 1 of 2, 8 experts
    ids = torch.tensor([[0, 5], [7, 4], [3, 2]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    local_ids, local_weights = local_routing(ids, weights, expert_map)
    assert local_ids.dtype == ids.dtype
    assert local_ids.tolist() == [[0, 1], [3, 0], [0, 0]]
    assert torch.equal(local_weights, torch.tensor([[0.0, 0.4], [0.7, 0.3], [0.0, 0.0]]))


@pytest.mark.parametrize("weighted", [True, False])
def test_ungated_experts_sum_each_tokens_chosen_experts(weighted: bool) -> None:
    """Nemotron-H's experts, ``relu(x @ up)^2 @ down``, each token's choices summed with the router's
    weights (or unweighted, when vLLM scaled the input by them already); a choice of -1 adds nothing."""
    torch.manual_seed(0)
    experts, hidden, inner = 4, 8, 6
    x = torch.randn(5, hidden)
    w1, w2 = torch.randn(experts, inner, hidden), torch.randn(experts, hidden, inner)
    b1, b2 = torch.randn(experts, inner), torch.randn(experts, hidden)
    ids = torch.tensor([[0, 3], [2, 2], [1, -1], [3, 0], [2, 1]], dtype=torch.int32)
    weights = torch.rand(5, 2)
    out = torch.full((5, hidden), float("nan"))
    ungated_experts(out, x, w1, w2, weights, ids, "relu2_no_mul", b1, b2, weighted=weighted)
    for t in range(5):
        expected = torch.zeros(hidden)
        for k in range(2):
            e = int(ids[t, k])
            if e >= 0:
                y = torch.relu(w1[e] @ x[t] + b1[e]).square() @ w2[e].T + b2[e]
                expected += y * weights[t, k] if weighted else y
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-5)


def test_the_vllm_patches_install_once() -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    assert run_ungated_experts() and translate_expert_ids() and process_experts_on_reload()
    apply, setup = CPUUnquantizedExperts.apply, UnquantizedFusedMoEMethod._setup_kernel
    assert run_ungated_experts() and translate_expert_ids() and process_experts_on_reload()
    assert CPUUnquantizedExperts.apply is apply and UnquantizedFusedMoEMethod._setup_kernel is setup


def test_the_counter_attributes_each_copy_to_the_refit_tensor_it_reads() -> None:
    buffer = torch.arange(64, dtype=torch.float32)  # one shared-memory chunk holding two tensors
    first, second = buffer[:32].view(4, 8), buffer[32:].view(8, 4)
    counter = RefitReadCounter()
    with counter:
        tracked = dict(counter.track([("a.weight", first), ("b.weight", second)]))
        torch.empty(2, 8).copy_(tracked["a.weight"].narrow(0, 2, 2))  # a row slice: 2 of 4 rows
        torch.empty(8, 2).copy_(tracked["b.weight"][:, 2:])  # a column slice: strided, half the bytes
        torch.empty(4, 8, device="meta").copy_(tracked["a.weight"])  # a meta destination reads nothing
        torch.empty(3).copy_(torch.ones(3))  # not a refit tensor
        tracked["b.weight"][:4].to(torch.float64)  # a conversion reads what it converts
        tracked["b.weight"].to("meta")  # onto meta: nothing
    assert counter.bytes_read == {"a.weight": 2 * 8 * 4, "b.weight": 8 * 2 * 4 + 4 * 4 * 4}


def test_a_freed_buckets_address_reused_by_the_next_is_attributed_to_the_next() -> None:
    counter = RefitReadCounter()
    with counter:
        first = torch.zeros(16)
        assert [name for name, _ in counter.track([("first.weight", first)])] == ["first.weight"]
        address = first.untyped_storage().data_ptr()
        del first
        second = torch.zeros(8)
        if second.untyped_storage().data_ptr() != address:  # the allocator chose elsewhere: force the case
            counter._spans[second.untyped_storage().data_ptr()] = counter._spans.pop(address)
        assert counter._source_name(second) is None  # the freed bucket's span does not claim it
        assert [name for name, _ in counter.track([("second.weight", second)])] == ["second.weight"]
        torch.empty(8).copy_(second)
    assert counter.bytes_read == {"first.weight": 0, "second.weight": 8 * 4}
