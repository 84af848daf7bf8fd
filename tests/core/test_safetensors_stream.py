"""The HF export's safetensors, written tensor by tensor (``nrl_core.sdk.safetensors_stream``):
files safetensors and Hugging Face read back exactly, and an export that never holds more than the
bucket in flight (counted through weak references, not timed)."""

from __future__ import annotations

import gc
import json
import weakref

import torch
from safetensors.torch import load_file

from nrl_core.sdk.hf_export import write_hf_export
from nrl_core.sdk.safetensors_stream import ShardWriter
from nrl_core.testing.tiny_models import cached_tiny_model


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(4, 6, generator=g), "b.weight": torch.randn(3, 5, generator=g).bfloat16(),
            "c.ids": torch.arange(7), "d.mask": torch.tensor([True, False, True]), "e.scale": torch.tensor(2.5),
            "f.half": torch.randn(2, 2, 2, generator=g).half(), "g.view": torch.randn(6, 4, generator=g).t()}


def test_shards_read_back_exactly_with_an_index_when_there_are_several(tmp_path) -> None:
    expected = tensors()
    for directory, max_bytes in (("one", 1 << 20), ("many", 100)):
        out = tmp_path / directory
        out.mkdir()
        writer = ShardWriter(out, max_bytes)
        for name, tensor in expected.items():
            writer.add(name, tensor)
        writer.close()
        files = sorted(p.name for p in out.iterdir())
        assert not [f for f in files if f.startswith(".")], files  # nothing half-written left behind
        if directory == "one":
            assert files == ["model.safetensors"]
            read = load_file(out / "model.safetensors")
        else:
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert sorted(index["weight_map"]) == sorted(expected) and len(set(index["weight_map"].values())) > 2
            assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
            read = {k: v for file in set(index["weight_map"].values()) for k, v in load_file(out / file).items()}
        assert read.keys() == expected.keys()
        for name, tensor in expected.items():
            assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name


def test_the_export_holds_no_more_than_the_bucket_in_flight_and_hf_loads_it(tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = cached_tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    seen: list[weakref.ref] = []
    live_at_each_bucket: list[int] = []

    def buckets():
        for name, param in model.state_dict().items():
            gc.collect()
            live_at_each_bucket.append(sum(ref() is not None for ref in seen))
            tensor = param.detach().clone()  # a fresh tensor per bucket, as a backend's gather makes
            seen.append(weakref.ref(tensor))
            yield [(name, tensor)]
            del tensor

    write_hf_export(buckets(), AutoConfig.from_pretrained(model_dir), str(model_dir), str(tmp_path / "hf"),
                    dtype="float32", writer=True, max_shard_bytes=64 << 10)
    assert max(live_at_each_bucket) == 0, live_at_each_bucket  # every earlier bucket was released
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(exported(ids).logits, model(ids).logits)


def test_a_name_streamed_twice_is_refused(tmp_path) -> None:
    import pytest

    writer = ShardWriter(tmp_path, 1 << 20)
    writer.add("a", torch.zeros(2))
    with pytest.raises(ValueError, match="the weight stream yields a twice"):
        writer.add("a", torch.zeros(2))
