"""The one-time conversion as a sharded Megatron checkpoint, and loading one rank's part of it.

Rank 0 converts once: a child process (a world of one, so that Megatron's collective save has a
world to itself while the run's ranks wait) builds the model at tensor/pipeline/expert parallel 1
on the meta device and converts it part by part (one decoder layer, or one module outside the
layers): a part is given memory, read from the HF safetensors, saved with
``megatron.core.dist_checkpointing`` into a directory of its own and dropped, so the converter
holds one part at a time, never the model. A run that is itself a world of one converts in its
own process (:func:`save_conversion`), sparing the child's imports. Every rank of every layout
(TP, PP, EP) then loads from it with its own model's ``sharded_state_dict()``: Megatron maps each
local parameter to its slice of the global tensor, and the reader fetches only the stored chunks
that overlap it.

Why the chunking (:func:`fine_grained`): the reader reads whole stored chunks, and a model saved at
TP=1 would store each matrix as one chunk, so a TP=2 rank would read all of it to keep half. Each
stored tensor is therefore split into a grid of up to 8 chunks per axis, which lines up with TP,
EP and PP splits of 2, 4 and 8: a rank reads about its share of the bytes, plus the small
replicated tensors (norms) and the checkpoint's index.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from nrl_backend_megatron.checkpoint_dir import PARTS
from nrl_core.api import NrlError, trim_host_heap

__all__ = ["CHUNKS_PER_AXIS", "convert_in_subprocess", "fine_grained", "load_hf_state", "load_shard",
           "save_conversion", "sharded_state_for", "write_sharded"]

logger = logging.getLogger(__name__)

CHUNKS_PER_AXIS = 8
# torchrun-style variables of the rank that spawns the converter; the converter is its own world
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID")


def load_hf_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the HF checkpoint at ``path`` (its ``*.safetensors`` files)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise NrlError(f"no *.safetensors files in {path}; the Megatron backend converts safetensors checkpoints")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _chunks(dim: int) -> int:
    return next(c for c in (CHUNKS_PER_AXIS, 4, 2, 1) if c <= max(dim, 1) and dim % c == 0)


def _pieces(tensor: Any) -> Any:
    """One ``ShardedTensor`` as a grid of smaller ones covering the same global slice."""
    if tensor.data is None or tensor.flattened_range is not None or tensor.axis_fragmentations is None:
        return tensor
    counts = [_chunks(d) for d in tensor.local_shape]
    if all(c == 1 for c in counts):
        return tensor
    p = tensor.prepend_axis_num
    size = tuple(d // c for d, c in zip(tensor.local_shape, counts))
    pieces = []
    for index in itertools.product(*(range(c) for c in counts)):
        window = tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, size))
        offset = tensor.global_offset[:p] + tuple(o + i * s for o, i, s in zip(tensor.global_offset[p:], index, size))
        fragments = tensor.axis_fragmentations[:p] + tuple(f * c for f, c in zip(tensor.axis_fragmentations[p:], counts))
        pieces.append(replace(tensor, data=tensor.data[window].contiguous(), local_shape=size, global_offset=offset,
                              axis_fragmentations=fragments))
    return pieces


def fine_grained(sharded: dict[str, Any]) -> dict[str, Any]:
    """``sharded`` (a model's ``sharded_state_dict()``, factories applied here) with every tensor
    stored as up to ``CHUNKS_PER_AXIS`` chunks per axis (see the module docstring)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)
    return dict_list_map_inplace(lambda v: _pieces(v) if isinstance(v, ShardedTensor) else v, sharded)


def write_sharded(model_path: str, out_dir: str, megatron_cfg: Mapping[str, Any], overrides: Mapping[str, Any],
                  trust_remote_code: bool) -> None:
    """Convert in this process, which must be a world of one (the child :func:`convert_in_subprocess` starts)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from nrl_backend_megatron import cpu_shim

    cpu_shim.install()
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        save_conversion(model_path, out_dir, megatron_cfg, overrides, trust_remote_code)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def save_conversion(model_path: str, out_dir: str, megatron_cfg: Mapping[str, Any], overrides: Mapping[str, Any],
                    trust_remote_code: bool) -> None:
    """Convert the HF checkpoint one part at a time and save each part, fine-grained, with
    dist_checkpointing: the model is built on the meta device, and a part (one decoder layer, or
    one module outside the layers) is given memory, read from the safetensors files, saved and
    dropped before the next, so the peak is a part, not the model. Needs Megatron's parallel state
    at TP=PP=EP=1 in a world of one. The random states are put back afterwards: building the
    model draws from them."""
    from megatron.core import dist_checkpointing, tensor_parallel
    from transformers import AutoConfig

    from nrl_backend_megatron.convert.mapping import hf_embedding_name, megatron_tensor, source_table
    from nrl_backend_megatron.model import ParallelLayout, build_model, transformer_config
    from nrl_backend_megatron.weights import canonical_param_names

    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved_tracker, saved_cpu = tracker.get_states(), torch.get_rng_state()
    try:
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        for key, value in overrides.items():
            setattr(hf_config, key, value)
        reader = SafetensorsReader(model_path)
        dtype = reader.floating_dtype(hf_embedding_name(hf_config))
        config = transformer_config(hf_config, ParallelLayout(), params_dtype=dtype, bf16=dtype == torch.bfloat16,
                                    fp16=dtype == torch.float16, moe=megatron_cfg)
        # Megatron's layers name the CUDA device themselves unless told to initialise on the CPU, and
        # Transformer Engine's unless told to use the meta device: then nothing escapes the context
        config.use_cpu_initialization, config.perform_initialization = True, False
        if hasattr(config, "init_model_with_meta_device"):
            config.init_model_with_meta_device = True
        with torch.device("meta"):
            model = build_model(hf_config, config, pre_process=True, post_process=True)
        held = sorted(name for name, param in model.named_parameters() if not param.is_meta)
        if held:
            logger.warning("the conversion built %d parameters with memory (%s, ...) instead of on the meta device; "
                           "it holds them until their part is saved", len(held), held[0])
        canonical = {name: canon for canon, (name, _) in canonical_param_names(model).items()}
        table = source_table(hf_config)
        parts: list[dict[str, Any]] = []
        for index, (group, names) in enumerate(_parts(model)):
            with reader.open() as get, torch.no_grad():
                for name in names:
                    tensor, param = megatron_tensor(canonical[name], get, hf_config, table), _give_memory(model, name)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise NrlError(f"shape mismatch for '{canonical[name]}': checkpoint {tuple(tensor.shape)} vs "
                                       f"model {tuple(param.shape)}")
                    param.copy_(tensor)
                    del tensor, param  # the part's last tensor (and the file it maps) not kept into the next
            sharded = {k: v for k, v in model.sharded_state_dict(metadata=dict(PER_LAYER)).items() if _part_of(k) == group}
            keys = sorted({v.key for v in sharded.values()})
            directory = f"part-{index:05d}"
            (Path(out_dir) / directory).mkdir()
            dist_checkpointing.save(fine_grained(sharded), str(Path(out_dir) / directory))
            del sharded
            for name in names:
                _give_memory(model, name, "meta")
            parts.append({"dir": directory, "keys": keys})
        (Path(out_dir) / PARTS).write_text(json.dumps({"parts": parts}, indent=1))
    finally:
        tracker.set_states(saved_tracker)
        torch.set_rng_state(saved_cpu)


# Each decoder layer under keys of its own (Megatron stacks identical layers into one tensor by
# default), so that a part holds whole tensors and every load of a part is checked for coverage.
PER_LAYER = {"non_homogeneous_layers": True}  # copied at each use: Megatron adds its groups to the dict


def _part_of(name: str) -> str:
    """The part a parameter (or sharded state entry) of the whole model belongs to: its decoder
    layer, else its module."""
    if name.startswith("decoder.layers."):
        return ".".join(name.split(".")[:3])
    return name.rsplit(".", 1)[0]


def _parts(model: Any) -> list[tuple[str, list[str]]]:
    from nrl_backend_megatron.weights import WEIGHT_BUFFERS

    groups: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        groups.setdefault(_part_of(name), []).append(name)
    for name, _ in model.named_buffers():
        if name.endswith(WEIGHT_BUFFERS):
            groups.setdefault(_part_of(name), []).append(name)
    return list(groups.items())


def _give_memory(model: Any, name: str, device: str = "cpu") -> torch.nn.Parameter:
    """Replace parameter ``name`` by one of the same shape, dtype and attributes on ``device``
    (uninitialised on the CPU; none on the meta device)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._buffers:  # a weight buffer (the routing bias)
        module._buffers[attr] = torch.empty(module._buffers[attr].shape, dtype=module._buffers[attr].dtype,
                                            device=device)
        return module._buffers[attr]
    old = module._parameters[attr]
    new = torch.nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=device), requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    module._parameters[attr] = new
    return new


class SafetensorsReader:
    """The tensors of an HF checkpoint's ``*.safetensors`` files, read one at a time. Files are
    mapped only while a part is read (:meth:`open`), so the process does not keep the whole
    checkpoint mapped as it goes."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.path, self.files = path, sorted(Path(path).glob("*.safetensors"))
        if not self.files:
            raise NrlError(f"no *.safetensors files in {path}; the Megatron backend converts safetensors checkpoints")
        self.where: dict[str, Path] = {}
        for file in self.files:
            with safe_open(str(file), "pt") as f:
                self.where.update(dict.fromkeys(f.keys(), file))

    def floating_dtype(self, name: str) -> torch.dtype:
        """The dtype of tensor ``name`` (the embedding's: the model's precision), else of the first
        floating-point tensor, else float32."""
        from safetensors import safe_open

        keys = [name] if name in self.where else []
        for key in keys + sorted(self.where):
            with safe_open(str(self.where[key]), "pt") as f:
                dtype = f.get_slice(key).get_dtype()
            if dtype in _FLOATING:
                return _FLOATING[dtype]
        return torch.float32

    @contextlib.contextmanager
    def open(self) -> Iterator[Callable[[str], torch.Tensor]]:
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            handles: dict[Path, Any] = {}

            def get(name: str) -> torch.Tensor:
                if name not in self.where:
                    raise NrlError(f"no tensor '{name}' in the safetensors files of {self.path}")
                file = self.where[name]
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(str(file), "pt"))
                return handles[file].get_tensor(name)

            yield get


_FLOATING = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def convert_in_subprocess(model_path: str, out_dir: Path, megatron_cfg: Mapping[str, Any],
                          overrides: Mapping[str, Any], trust_remote_code: bool) -> None:
    """Run :func:`write_sharded` in a child process with this process's environment and imports."""
    spec = out_dir.parent / f".{out_dir.name}.request.json"
    spec.write_text(json.dumps({"model_path": model_path, "out_dir": str(out_dir), "megatron_cfg": dict(megatron_cfg),
                                "overrides": dict(overrides), "trust_remote_code": trust_remote_code}, default=str))
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        proc = subprocess.run([sys.executable, "-m", __name__, str(spec)], env=env, capture_output=True, text=True)
    finally:
        spec.unlink(missing_ok=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()] or [f"exit {proc.returncode}"]
        raise NrlError(f"converting {model_path} into {out_dir} failed: {lines[-1].strip()}")


def load_shard(model: Any, path: Path, sharded: Any = None, fresh: tuple[str, ...] = ()) -> None:
    """Load ``model``'s part of the dist_checkpointing directory at ``path`` (collective over the
    run's ranks): an HF conversion, or a Megatron-LM or Megatron-Bridge iteration. Only the model's
    tensors are read: a training checkpoint's ``common.pt`` (Megatron-LM's pickled ``args``) is
    never unpickled here, see :func:`~nrl_backend_megatron.convert.megatron_checkpoint.read_args`.
    ``fresh`` names the parameters the directory does not hold (a value head on a causal LM's
    conversion): left out of ``sharded`` and left as they are; every other one must be loaded."""
    from megatron.core import dist_checkpointing

    from nrl_backend_megatron.safe_load import refusal, safe_dist_checkpointing, start_load

    safe_dist_checkpointing()  # an imported Megatron-LM directory is someone else's: nothing of it runs
    start_load(path)
    sharded = sharded if sharded is not None else sharded_state_for(model, path)
    wanted = {k: v for k, v in sharded.items() if k not in fresh}
    try:
        if (path / PARTS).is_file():
            missing, unexpected = _load_parts(model, wanted, path)
        else:
            state = dist_checkpointing.load({"model": wanted}, str(path), common_strategy=_model_tensors_only())
            result = model.load_state_dict(state["model"], strict=False)
            missing, unexpected = set(result.missing_keys), set(result.unexpected_keys)
    except BaseException:
        if refusal() is not None:
            raise refusal() from None
        raise
    missing -= set(fresh)
    if missing or unexpected:
        raise NrlError(f"{path} does not match the model: missing {sorted(missing)[:4]}, unexpected "
                       f"{sorted(unexpected)[:4]}")


def sharded_state_for(model: Any, path: Path) -> Any:
    """``model``'s sharded state as the checkpoint at ``path`` keys it: a conversion in parts keeps
    each decoder layer under keys of its own, every other checkpoint Megatron's default."""
    if (path / PARTS).is_file():
        return model.sharded_state_dict(metadata=dict(PER_LAYER))
    return model.sharded_state_dict()


def _load_parts(model: Any, wanted: dict[str, Any], path: Path) -> tuple[set[str], set[str]]:
    """``wanted`` (``model``'s sharded state) from a conversion saved part by part: each part loads
    the entries whose keys it holds (on every rank, so a rank that holds none of a part's keys
    still takes part in its collective load); an entry no part holds is refused. Each part goes
    into the model as soon as it is read, since some of its tensors are new ones (a gated MLP's
    input projection is read as two halves and put together): the model's whole set of those
    would otherwise be alive at once. Returns the keys the model missed and did not expect."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    parts = json.loads((path / PARTS).read_text())["parts"]
    held = {key: part["dir"] for part in parts for key in part["keys"]}
    missing = sorted({v.key for v in wanted.values()} - held.keys())
    problem = f"{path} does not match the model: it holds no {missing[:4]}; delete it to convert again" \
        if missing else None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # every rank stops, none waits
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, problem)
        problem = next((p for p in every if p), None)
    if problem:
        raise NrlError(problem)
    by_part: dict[str, dict[str, Any]] = {part["dir"]: {} for part in parts}
    for k, v in wanted.items():
        by_part[held[v.key]][k] = v
    missing: set[str] | None = None
    unexpected: set[str] = set()
    for directory, subset in by_part.items():
        part = dist_checkpointing.load(subset, str(path / directory), common_strategy=_model_tensors_only())
        result = model.load_state_dict(part, strict=False)
        del part
        trim_host_heap()  # the part's read buffers leave the process before the next part's are read
        missing = set(result.missing_keys) if missing is None else missing & set(result.missing_keys)
        unexpected |= set(result.unexpected_keys)
    return missing or set(), unexpected


def _model_tensors_only() -> Any:
    """A load strategy that skips the checkpoint's common (pickled, non-tensor) state."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class ModelTensorsOnly(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> dict[str, Any]:
            return {}

    return ModelTensorsOnly()


def _main(argv: list[str]) -> None:
    request = json.loads(Path(argv[0]).read_text())
    write_sharded(request["model_path"], request["out_dir"], request["megatron_cfg"], request["overrides"],
                  bool(request["trust_remote_code"]))


if __name__ == "__main__":
    _main(sys.argv[1:])
