"""Let Megatron-Core run on a machine without CUDA: the one place the CUDA→CPU redirection lives.

Why it exists: Megatron-Core hard-codes ``torch.cuda.current_device()``, ``device="cuda"`` factory
calls, ``Tensor.cuda()`` and the CUDA RNG-state functions (tensor-parallel RNG tracker). On a
CPU-only machine (tests, the CPU demo) those calls are redirected to the CPU. ``install()`` is a
no-op when CUDA is available, so nothing here ever runs on a GPU machine. Idempotent.

One fix is not about CUDA: :func:`define_missing_te_names` steps around a megatron-core 0.16 bug
that breaks MoE routing wherever Transformer Engine is absent, and runs on every machine.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

_INSTALLED = False

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like", "ones_like",
              "randn", "rand", "randint", "as_tensor")


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spelling (``"cuda"``, ``"cuda:0"``, an index, a ``torch.device``) to the CPU."""
    import torch

    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


def _redirect_device_kwarg(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__nrl_cpu_shim__ = True  # type: ignore[attr-defined]
    return wrapper


def define_missing_te_names() -> None:
    """Megatron-Core's MoE router reads ``moe_utils.te_general_gemm``, which the module only defines
    when Transformer Engine imports; without TE, routing raises ``NameError``. ``None`` is the
    value the router's own fallback (plain ``torch.mm``) checks for. Latent attention's own
    Transformer Engine switch is set from what actually imported."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # Multi-head latent attention counts TE as present when Megatron's TE extension module imports,
    # which it does without TE, and then type-checks against its ``TELinear``, a placeholder mock.
    import megatron.core.transformer.multi_latent_attention as latent

    from nrl_backend_megatron.model import transformer_engine_installed

    if not transformer_engine_installed():
        latent.HAVE_TE = False


def active() -> bool:
    """Whether the redirection is installed in this process."""
    return _INSTALLED


def install() -> bool:
    """Install the redirection when CUDA is absent; returns whether it is active."""
    global _INSTALLED
    import torch

    define_missing_te_names()
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
    # ``with torch.device("meta")`` recognises factory functions by identity, from a set it builds
    # once; built after the wrapping, it would hold the wrappers and stop redirecting torch's own
    # functions (transformers then initialises models it builds on "meta" on the CPU, and the
    # loaded model's RoPE buffers are left uninitialised).
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _redirect_device_kwarg(getattr(torch, name)))

    original_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and isinstance(args[0], (str, torch.device, int)) and not isinstance(args[0], bool):
            args = (_cpu_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to  # type: ignore[assignment]

    # The tensor-parallel RNG tracker swaps CUDA generator states; on CPU it swaps the CPU one.
    import megatron.core.tensor_parallel.random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # On CPU the tracker's "CUDA" generator *is* the CPU one, so its check that the CPU state is
    # untouched inside a fork always fires; the message is noise here, not a bug.
    logging.getLogger(mp_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())
    _spell_cpu_tensors_as_cuda_in_distributed_optimizer()
    _INSTALLED = True
    return True


def _spell_cpu_tensors_as_cuda_in_distributed_optimizer() -> None:
    """The distributed optimizer sorts parameters by ``Tensor.type()`` strings and refuses any
    that is not ``torch.cuda.*Tensor``; while it is built, a CPU tensor answers with the CUDA
    spelling of its type, as every other CUDA spelling here means the CPU."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_init = DistributedOptimizer.__init__
    original_type = torch.Tensor.type

    def cuda_spelling(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or not name.startswith("torch.") or self.device.type != "cpu":
            return name
        return "torch.cuda." + name.removeprefix("torch.")

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        torch.Tensor.type = cuda_spelling  # type: ignore[assignment]
        try:
            original_init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = original_type  # type: ignore[assignment]

    DistributedOptimizer.__init__ = init  # type: ignore[method-assign]
