"""Megatron-Core's fused functions compile on their first call where torch is built without CUDA
(nrl_backend_megatron/compile_on_call.py): the same results, a cheaper import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")

from nrl_backend_megatron.compile_on_call import compiled_on_first_call


def test_a_function_compiles_once_on_its_first_call_with_the_decorators_options() -> None:
    calls = []

    def compile_now(fn, **options):
        calls.append(options)
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    deferred = compiled_on_first_call(compile_now)

    @deferred(fullgraph=True)
    def scaled(x, scale=2):
        """Doubles."""
        return x * scale

    assert calls == [] and scaled.__name__ == "scaled" and scaled.__doc__ == "Doubles."
    assert scaled(3) == ("compiled", 6) and scaled(3, scale=3) == ("compiled", 9)
    assert calls == [{"fullgraph": True}]
    module = torch.nn.Linear(2, 2)  # not a plain function: compiled at once, as torch.compile would
    assert deferred(module)(torch.ones(2))[0] == "compiled" and len(calls) == 2


@pytest.mark.slow
@pytest.mark.skipif(torch.version.cuda is not None, reason="torch built for CUDA compiles at import, as before")
def test_importing_megatron_through_nrl_leaves_its_fused_functions_to_compile_on_first_call() -> None:
    """In a fresh process (a test process may have imported Megatron-Core first): Megatron-Core's
    fused functions are deferred, and Inductor's compiler is not imported."""
    script = """
import sys
import nrl_backend_megatron
import megatron.core
import megatron.core.jit as jit
from megatron.core.fusions.fused_bias_gelu import bias_gelu
assert "torch._inductor.compile_fx" not in sys.modules, "inductor was imported"
assert jit.jit_fuser.__qualname__.startswith("compiled_on_first_call"), jit.jit_fuser
assert bias_gelu.__qualname__ == "bias_gelu" and bias_gelu.__code__.co_name == "first_call_compiles"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
