"""The hf generation backend (plugins/nrl_gen_hf): nrl's generation conformance suite, and what the
suite does not pin down, each against a plain transformers reference on a tiny local model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("nrl_gen_hf")
pytest.importorskip("nrl_backend_dtensor")

from nrl_core.algorithms.refit_orchestrator import choose_transport, refit  # noqa: E402
from nrl_core.checkpoint.to_hf import hf_logprobs, hf_model  # noqa: E402
from nrl_core.contracts import TokenBatch  # noqa: E402
from nrl_core.errors import ConfigError, NrlError  # noqa: E402
from nrl_core.refit import RefitError  # noqa: E402
from nrl_core.refit.endpoints import refit_local  # noqa: E402
from nrl_core.refit.hf_source import HFWeightSource  # noqa: E402
from nrl_core.refit.plan import RefitPlan
from nrl_core.testing.conformance import generation_backend_suite, scenarios  # noqa: E402
from nrl_core.testing.refit_host import perturb_weights  # noqa: E402
from nrl_core.testing.tiny_models import cached_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LOGPROB_TOLERANCE = 1e-4
"""Engine logprobs (KV-cached decoding) vs one full HF forward, float32 on CPU: reduction order only."""

TestConformance = generation_backend_suite(
    "hf", training_backend="dtensor", training_overrides=["policy.optimizer.kwargs.lr=1e-2"])
"""Refit from a DTensor worker after three steps (a dense Llama)."""

TestConformanceMoE = generation_backend_suite("hf", family="qwen3_moe", size="tiny")
"""Refit of a perturbed HF Qwen3-MoE: transformers fuses its experts, the refit sends one tensor each."""


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", "small")


@pytest.fixture(scope="module")
def reference(model_dir) -> Any:
    return hf_model(model_dir)


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    # the first two have the same length: they decode as one batch
    return [tok(t).input_ids for t in ("Q: What is 3 + 4?\nA:", "Q: What is 40 - 2?\nA:", "Answer with a number.")]


def engine(model_dir: Path, *overrides: str, max_new_tokens: int = 8, total: int = 64) -> Any:
    from nrl_gen_hf.worker import HFGenerationWorker

    config = scenarios.conformance_config(
        "dtensor", str(model_dir),
        overrides=["policy.generation.backend=hf", f"policy.generation.max_new_tokens={max_new_tokens}",
                   f"policy.max_total_sequence_length={total}", *overrides])
    return HFGenerationWorker(config)


def forward_logprobs(reference: Any, prompts: list[list[int]], responses: list[list[int]], temperature: float,
                     ) -> list[torch.Tensor]:
    """Each response token's logprob under ``softmax(logits / temperature)`` of one full forward."""
    out = []
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([prompt + response])
        batch = TokenBatch(input_ids=ids, input_lengths=torch.tensor([ids.shape[1]]), fields={})
        out.append(hf_logprobs(reference, batch, temperature)[0, len(prompt):])
    return out


def test_sampled_logprobs_equal_hf_forward_at_the_sampling_temperature(model_dir, reference, prompts):
    worker = engine(model_dir, "policy.generation.temperature=0.7")
    out = worker.generate(prompts * 2)
    expected = forward_logprobs(reference, prompts * 2, out.token_ids, 0.7)
    for got, want in zip(out.logprobs, expected):
        assert len(got) == len(want) > 0
        assert float((torch.tensor(got) - want).abs().max()) < LOGPROB_TOLERANCE
    at_one = forward_logprobs(reference, prompts * 2, out.token_ids, 1.0)
    assert max(float((torch.tensor(g) - w).abs().max()) for g, w in zip(out.logprobs, at_one)) > 1e-2


def test_top_k_logprobs_are_over_the_kept_tokens(model_dir, reference, prompts):
    """vLLM's processed logprobs: after temperature and top-k, renormalised over the k tokens kept."""
    worker = engine(model_dir, "policy.generation.temperature=0.7", "policy.generation.top_k=5")
    out = worker.generate(prompts)
    for prompt, response, got in zip(prompts, out.token_ids, out.logprobs):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1:-1].float() / 0.7
        top = logits.topk(5, dim=-1)
        kept = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
        want = torch.log_softmax(kept, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert torch.isfinite(want).all(), "a token outside the top 5 was sampled"
        assert float((torch.tensor(got) - want).abs().max()) < LOGPROB_TOLERANCE


def test_greedy_equals_hf_greedy_whatever_the_batching(model_dir, reference, prompts):
    expected = scenarios.hf_greedy(reference, prompts, 8)
    for batch_size in (1, 64):
        out = engine(model_dir, f"policy.generation.hf_cfg.batch_size={batch_size}").generate(prompts, greedy=True)
        assert out.token_ids == expected
        # greedy reports the model's own distribution (temperature 1), as vLLM does
        want = forward_logprobs(reference, prompts, out.token_ids, 1.0)
        assert max(float((torch.tensor(g) - w).abs().max()) for g, w in zip(out.logprobs, want)) < LOGPROB_TOLERANCE


def test_stop_token_ids_and_stop_strings_end_a_response_and_stay_in_it(model_dir, reference, prompts):
    from transformers import AutoTokenizer

    full = scenarios.hf_greedy(reference, prompts[:1], 8)[0]
    end = next(i for i in range(1, len(full)) if full[i] not in full[:i])  # the stop token's first place
    out = engine(model_dir, f"policy.generation.stop_token_ids=[{full[end]}]").generate(prompts[:1], greedy=True)
    assert out.token_ids == [full[:end + 1]] and out.finish_reasons == ["stop"]
    assert len(out.logprobs[0]) == end + 1

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    stop = tok.decode(full[3:5]).strip()[-2:] or tok.decode(full[3:5])
    out = engine(model_dir, f"policy.generation.stop_strings=['{stop}']").generate(prompts[:1], greedy=True)
    kept = out.token_ids[0]
    assert stop in tok.decode(kept) and stop not in tok.decode(kept[:-1]), (stop, kept, full)
    assert kept == full[:len(kept)] and out.finish_reasons == ["stop"]


def test_the_response_fits_max_total_sequence_length(model_dir, prompts):
    worker = engine(model_dir, max_new_tokens=8, total=len(prompts[2]) + 3)
    out = worker.generate([prompts[2]], greedy=True)
    assert len(out.token_ids[0]) == 3 and out.finish_reasons == ["length"]
    with pytest.raises(NrlError, match="max_total_sequence_length"):
        worker.generate([prompts[2] + [5, 6, 7]])


def test_sampling_is_reproducible_and_leaves_torch_rng_alone(model_dir, prompts):
    worker = engine(model_dir)
    state = worker.sampling_state()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = worker.generate(prompts * 4)
    assert torch.equal(torch.get_rng_state(), before), "sampling moved the process's torch generator"
    second = worker.generate(prompts * 4)
    assert first.token_ids != second.token_ids, "two calls sampled the same tokens"
    assert len({tuple(t) for t in first.token_ids}) > len(prompts), "repeated prompts got identical samples"
    worker.load_sampling_state(state)
    assert worker.generate(prompts * 4).token_ids == first.token_ids
    other = engine(model_dir, "policy.generation.hf_cfg.seed=7")
    assert other.generate(prompts * 4).token_ids != first.token_ids


def test_sleep_and_wake_keep_the_weights(model_dir, prompts):
    worker = engine(model_dir)
    before = worker.generate(prompts, greedy=True)
    assert worker.finish_generation() is False  # parked, not dropped: no refit needed
    with pytest.raises(NrlError, match="prepare_for_generation"):
        worker.generate(prompts)
    worker.prepare_for_generation(["weights"])
    with pytest.raises(NrlError, match="kv_cache"):
        worker.generate(prompts)
    worker.prepare_for_generation(["kv_cache"])
    assert worker.generate(prompts, greedy=True).token_ids == before.token_ids
    with pytest.raises(ValueError, match="unknown sleep tags"):
        worker.prepare_for_generation(["optimizer"])


def test_dummy_load_format_waits_for_the_first_refit(model_dir, reference, prompts):
    worker = engine(model_dir, "policy.generation.hf_cfg.load_format=dummy")
    assert worker.weight_version == -1
    with pytest.raises(NrlError, match="import_weights first"):
        worker.generate(prompts)
    assert refit(HFWeightSource(model_dir), worker, RefitPlan(bucket_bytes=scenarios.BUCKET_BYTES)).version == 0
    assert worker.generate(prompts, greedy=True).token_ids == scenarios.hf_greedy(reference, prompts, 8)


def test_refit_through_shared_memory_in_bfloat16(model_dir, prompts, tmp_path):
    """The non-colocated path (buckets rebuilt from /dev/shm handles), into a bfloat16 engine fed
    float32 tensors: they are cast on the way in."""
    worker = engine(model_dir, "policy.generation.hf_cfg.precision=bfloat16")
    assert next(worker.model.parameters()).dtype == torch.bfloat16
    trained = hf_model(model_dir)
    perturb_weights(trained, seed=3)
    report = refit_local(HFWeightSource(trained), worker, choose_transport("same_node", "shared_memory"),
                         scenarios.BUCKET_BYTES, "float32")
    assert report.version == worker.weight_version == 1
    for name, tensor in trained.state_dict().items():
        assert torch.equal(worker.model.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_a_moe_refit_lands_in_the_fused_expert_parameters():
    """Refits carry one tensor per expert (the checkpoint's layout); transformers holds a layer's
    experts fused: every element must land where transformers' own loading puts it."""
    moe_dir = cached_tiny_model("qwen3_moe", "tiny")
    worker = engine(moe_dir)
    assert worker.layout.fused, "the tiny Qwen3-MoE should have fused experts"
    trained = hf_model(moe_dir)
    perturb_weights(trained, seed=5)
    refit(HFWeightSource(trained), worker, RefitPlan(bucket_bytes=scenarios.BUCKET_BYTES))
    loaded = worker.model.state_dict()
    for name, tensor in trained.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_a_refit_named_for_another_model_is_refused_before_loading(model_dir, prompts):
    """Manifest and tensors agree with each other but not with the engine's model: the layout check
    catches what the manifest check cannot, and the weights stay."""

    class Renamed(HFWeightSource):
        def _named(self, dtype: str) -> Any:
            for name, tensor in super()._named(dtype):
                yield name.replace("model.norm.", "model.final_norm."), tensor

        def weight_manifest(self, dtype: str) -> Any:
            from nrl_core.refit.buckets import manifest_of

            return manifest_of(self._named(dtype))

    worker = engine(model_dir)
    before = worker.generate(prompts, greedy=True).token_ids
    trained = hf_model(model_dir)
    perturb_weights(trained, seed=3)
    with pytest.raises(RefitError, match="model.norm.weight") as info:
        refit(Renamed(trained), worker, RefitPlan(bucket_bytes=scenarios.BUCKET_BYTES))
    assert "model.final_norm.weight" in str(info.value) and "\n" not in str(info.value)
    assert worker.weight_version == 0 and worker.generate(prompts, greedy=True).token_ids == before


def test_bad_hf_cfg_values_are_one_line_errors(model_dir):
    with pytest.raises(ConfigError) as info:
        engine(model_dir, "policy.generation.hf_cfg.precision=fp8")
    assert info.value.key_path == "policy.generation.hf_cfg.precision"
    with pytest.raises(ConfigError) as info:
        engine(model_dir, "policy.generation.top_p=0")
    assert info.value.key_path == "policy.generation.top_p"
    with pytest.raises(ConfigError) as info:
        engine(model_dir, "policy.generation.hf_cfg.batch_size=0")
    assert info.value.key_path == "policy.generation.hf_cfg.batch_size"


def test_the_tiny_cpu_grpo_config_checks(model_dir):
    config = REPO / "examples" / "configs" / "grpo_tiny_cpu_hf.yaml"
    proc = subprocess.run([sys.executable, "-m", "nrl_core.cli", "config", "check", str(config),
                           f"policy.model_name={model_dir}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "generation backend: hf (nrl-gen-hf)" in proc.stdout + proc.stderr
