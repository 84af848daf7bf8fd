"""LoRA on the dtensor worker (world size 1, in the pytest process, with and without FSDP2):
only the adapters train and hold optimizer state, the reference policy is the base model, what
leaves the worker is the merged model PEFT itself computes, checkpoints hold only the adapters
and resume exactly, and bad ``lora_cfg`` values are one line."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

pytest.importorskip("peft")

from common import make_batch, make_config

from nrl_backend_dtensor.schema import LORA_SCHEMA
from nrl_backend_dtensor.worker import DTensorPolicyWorker
from nrl_core.algorithms.loss import NLLLoss
from nrl_core.contracts import CheckpointOptions
from nrl_core.errors import ConfigError, NrlError
from nrl_core.testing.distributed import gather_shards

LORA = {"enabled": True, "dim": 4, "alpha": 8}


def lora_worker(lora: dict | None = None, fsdp: bool = False, **overrides) -> DTensorPolicyWorker:
    section = LORA_SCHEMA.validate({**LORA, **(lora or {})}, "policy.dtensor_config.lora_cfg")
    config = make_config(dtensor_config={"lora_cfg": section}, **overrides)
    if not fsdp:
        return DTensorPolicyWorker(config, 0, 1)
    from nrl_backend_dtensor import parallel

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel, "fsdp_needed", lambda *a, **k: True)
        return DTensorPolicyWorker(config, 0, 1)


def named(w: DTensorPolicyWorker) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in w.model.named_parameters()}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@pytest.mark.parametrize("fsdp", [False, True])
def test_only_the_adapters_train_and_hold_optimizer_state(fsdp: bool) -> None:
    w = lora_worker(fsdp=fsdp)
    batch = make_batch()
    before = named(w)
    trainable = [n for n, p in w.model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(n) for n in trainable)
    assert len(trainable) == 2 * 14  # q, k, v, o, gate, up, down in each of the 2 layers; not the head
    start = gather_shards(w.get_logprobs(batch), batch)
    losses = [w.train(batch, NLLLoss())["loss"] for _ in range(3)]
    assert losses[2] < losses[0]
    after = named(w)
    assert all(torch.equal(before[n], after[n]) for n in before if not is_adapter(n))
    assert all(not torch.equal(before[n], after[n]) for n in before if ".lora_B." in n)  # B starts at zero
    state = w.optimizer.state
    assert len(state) == len(trainable) and all(p.requires_grad for p in state)
    # the reference policy is the base model: the adapters switched off, not a copy of the weights
    assert w.reference is None
    assert torch.equal(gather_shards(w.get_reference_logprobs(batch), batch), start)
    assert not torch.equal(gather_shards(w.get_logprobs(batch), batch), start)


def test_the_exported_model_is_peft_merge_and_unload_of_the_trained_adapters(tmp_path) -> None:
    """What refit and the HF export send is PEFT's own merge of the adapters, and a plain HF model
    of those weights computes the worker's logprobs."""
    from peft import inject_adapter_in_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from nrl_backend_dtensor.lora import lora_config
    from nrl_core.api import hf_logprobs

    w = lora_worker(lora={"target_modules": ["q_proj", "v_proj", "down_proj"], "match_all_linear": False})
    batch = make_batch()
    for _ in range(2):
        w.train(batch, NLLLoss())
    exported = {n: t for bucket in w.export_weights(1 << 20, "float32") for n, t in bucket}
    assert [s.name for s in w.weight_manifest("float32")] == list(exported)
    base = AutoModelForCausalLM.from_pretrained(w.policy["model_name"], dtype=torch.float32)
    assert sorted(exported) == sorted(base.state_dict())
    peft_model = inject_adapter_in_model(lora_config(w.lora), base)
    adapters = {n.removeprefix("hf.").replace(".default", ""): p.detach() for n, p in w.model.named_parameters()
                if is_adapter(n)}
    set_peft_model_state_dict(peft_model, adapters)
    merged = {}
    for module in peft_model.modules():
        if hasattr(module, "merge") and hasattr(module, "base_layer"):
            module.merge()
    for name, tensor in peft_model.state_dict().items():
        if not is_adapter(name):
            merged[name.replace(".base_layer", "")] = tensor
    assert max((exported[n] - merged[n]).abs().max().item() for n in merged) < 1e-6
    plain = AutoModelForCausalLM.from_pretrained(w.policy["model_name"], dtype=torch.float32)
    plain.load_state_dict(exported)
    ours = gather_shards(w.get_logprobs(batch), batch)
    assert (hf_logprobs(plain.eval(), batch, 1.0) - ours).abs().max() < 1e-5


def test_the_exported_adapter_loads_with_peft_and_gives_the_trained_models_logprobs(tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nrl_core.api import hf_logprobs

    w = lora_worker(fsdp=True)
    batch = make_batch()
    for _ in range(2):
        w.train(batch, NLLLoss())
    w.export_hf(str(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= \
        {p.name for p in (tmp_path / "adapter").iterdir()}
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(w.policy["model_name"], dtype=torch.float32)
    trained = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ours = gather_shards(w.get_logprobs(batch), batch)
    assert (hf_logprobs(trained, batch, 1.0) - ours).abs().max() < 1e-5


OPTIONS = CheckpointOptions(fully_parallel_save=True, fully_parallel_load=True, async_save=False, load_rng=True)


def saved_after_one_step(path) -> tuple[DTensorPolicyWorker, list[float]]:
    """A LoRA worker trained one step and saved to ``path``, and its next two losses."""
    batch = make_batch()
    worker = lora_worker()
    worker.train(batch, NLLLoss())
    worker.save_checkpoint(str(path), OPTIONS)
    return worker, [worker.train(batch, NLLLoss())["loss"] for _ in range(2)]


def test_checkpoints_hold_only_the_adapters_and_resume_exactly(tmp_path) -> None:
    _, expected = saved_after_one_step(tmp_path / "ckpt")
    full = lora_worker(lora={"enabled": False})
    full.save_checkpoint(str(tmp_path / "full"), OPTIONS)
    size = lambda p: sum(f.stat().st_size for f in p.rglob("*.distcp"))  # noqa: E731
    assert size(tmp_path / "ckpt") < size(tmp_path / "full") / 4  # adapters and their Adam moments only
    b = lora_worker()
    b.load_checkpoint(str(tmp_path / "ckpt"), OPTIONS)
    assert [b.train(make_batch(), NLLLoss())["loss"] for _ in range(2)] == expected
    with pytest.raises(NrlError, match="is a LoRA checkpoint and this run trains full weights"):
        full.load_checkpoint(str(tmp_path / "ckpt"), OPTIONS)
    wider = lora_worker(lora={"dim": 8})
    with pytest.raises(NrlError, match=r"lora_A\.default\.weight' has shape \[4, 64\] there and \[8, 64\]"):
        wider.load_checkpoint(str(tmp_path / "ckpt"), OPTIONS)


@pytest.mark.parametrize("parallel_load", [True, False])
def test_adapters_of_a_tied_model_resume_from_safetensors(tmp_path, parallel_load) -> None:
    """Gemma 3 ties its output layer to the embeddings, both frozen under LoRA: the safetensors
    checkpoint holds the adapters, and a resume is exact through either load path."""
    options = CheckpointOptions(model_save_format="safetensors", fully_parallel_load=parallel_load)
    a = lora_worker(family="gemma3")
    a.train(make_batch(), NLLLoss())
    a.save_checkpoint(str(tmp_path / "ckpt"), options)
    expected = a.train(make_batch(), NLLLoss())["loss"]
    b = lora_worker(family="gemma3")
    b.load_checkpoint(str(tmp_path / "ckpt"), options)
    assert b.train(make_batch(), NLLLoss())["loss"] == expected


def test_a_checkpoint_of_adapters_for_another_base_is_refused(tmp_path) -> None:
    from nrl_core.testing.tiny_models import cached_tiny_model

    saved_after_one_step(tmp_path / "ckpt")
    other_base = str(cached_tiny_model("llama", size="tiny", seed=1))  # same architecture, other weights
    b = lora_worker(model_name=other_base)
    with pytest.raises(NrlError, match="holds LoRA adapters of another base model") as caught:
        b.load_checkpoint(str(tmp_path / "ckpt"), OPTIONS)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("lora, key, says", [
    ({"dropout": 0.1, "dropout_position": "post"}, "dropout_position", "'post'"),
])
def test_bad_lora_sections_are_one_line(lora: dict, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        lora_worker(lora=lora)
    assert caught.value.key_path == f"policy.dtensor_config.lora_cfg.{key}" and says in str(caught.value)


def test_no_target_named_adapts_every_linear_layer_but_the_excluded() -> None:
    """NeMo RL's recipes that set match_all_linear: false with no target_modules and a list of
    exclude_modules mean every linear layer but those, as NeMo Automodel reads them."""
    w = lora_worker(lora={"match_all_linear": False, "target_modules": [], "exclude_modules": ["*down_proj"]})
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in w.model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"}


def test_targets_that_match_nothing_are_one_line() -> None:
    with pytest.raises(ConfigError, match="matches no linear layer"):
        lora_worker(lora={"match_all_linear": False, "target_modules": ["no_such_proj"]})


def test_tensor_parallel_lora_is_refused_at_config_check() -> None:
    from nrl_backend_dtensor.lora import check_section

    section = LORA_SCHEMA.validate(LORA, "policy.dtensor_config.lora_cfg")
    with pytest.raises(ConfigError, match="FSDP data parallelism only"):
        check_section(section, 2)
