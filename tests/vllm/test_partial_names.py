"""Which checkpoint tensors an expert-parallel vLLM rank names as not wanted (no engine needed)."""

from nrl_gen_vllm.partial import experts_elsewhere

NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
         *[f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
           for layer in (0, 1) for expert in range(4) for proj in ("gate_proj", "up_proj", "down_proj")],
         "model.layers.1.mlp.shared_expert.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight"]


def test_only_other_ranks_experts_of_the_split_layers_are_elsewhere() -> None:
    held = {"model.layers.0.mlp.experts": [0, 1], "model.layers.1.mlp.experts": [2, 3]}
    elsewhere = experts_elsewhere(NAMES, held)
    assert elsewhere == {f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
                         for layer, experts in ((0, (2, 3)), (1, (0, 1))) for expert in experts
                         for proj in ("gate_proj", "up_proj", "down_proj")}


def test_a_layer_not_listed_keeps_every_expert() -> None:
    """vLLM lists only layers that split their experts (and not those with redundant experts)."""
    assert experts_elsewhere(NAMES, {"model.layers.0.mlp.experts": [0, 1, 2, 3]}) == frozenset()
    assert experts_elsewhere(NAMES, {}) == frozenset()
