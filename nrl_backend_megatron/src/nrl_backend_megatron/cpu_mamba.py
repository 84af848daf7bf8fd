"""Megatron-Core's Mamba mixer without ``mamba_ssm``: the state-space scan and its gated norm in torch.

Why: Megatron's ``MambaMixer`` trains through ``mamba_ssm``'s Triton kernels (the fused
convolution, chunked scan and gate, and a grouped RMS norm), which build for CUDA only. Without
them the mixer refuses to build, so Nemotron-H could not train on Megatron where ``mamba_ssm``
does not install (the CPU). This module computes the same function in torch, chunk by chunk as
the kernel does (within a chunk the scan is a masked matrix product, across chunks a recurrence
on the state), and gives it to Megatron's mixer only when ``mamba_ssm`` is absent: on a GPU with
``mamba_ssm`` installed, Megatron's own kernels run.

A packed micro-batch (``seq_idx``) is scanned one sequence at a time, so no state and no
convolution window crosses from one sequence into the next.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["GatedGroupRMSNorm", "install", "split_conv1d_scan"]

_INSTALLED = False


def _causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` ``[b, l, c]`` with ``weight`` ``[c, w]``, then SiLU."""
    length, width = x.shape[1], weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[-1])
    return F.silu(out[..., :length]).transpose(1, 2)


def _scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
          chunk: int) -> torch.Tensor:
    """The selective state-space scan ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = C_t h_t``
    for ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]``, ``A`` ``[h]`` and ``B``, ``C`` ``[b, l, h, n]``
    (each head's group already picked), in float32."""
    batch, length, heads, _ = x.shape
    pad = (-length) % chunk
    if pad:  # zero steps at the end: they neither decay nor feed the states of earlier steps
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    n_chunks = x.shape[1] // chunk

    def chunked(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, n_chunks, chunk, *t.shape[2:])

    x, dt, B, C = chunked(x), chunked(dt), chunked(B), chunked(C)
    log_decay = torch.cumsum(dt * A, dim=2)  # [b, c, q, h]: log of the decay from the chunk's start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    between = log_decay.unsqueeze(3) - log_decay.unsqueeze(2)  # [b, c, i, j, h]: from step j to step i
    decay = torch.exp(between.masked_fill(~causal[:, :, None], float("-inf")))
    weights = torch.einsum("bcihn,bcjhn->bcijh", C, B) * decay * dt.unsqueeze(2)
    within = torch.einsum("bcijh,bcjhp->bcihp", weights, x)
    # each chunk's own contribution to the state at its end, then the state carried across chunks
    to_end = torch.exp(log_decay[:, :, -1:] - log_decay) * dt  # [b, c, q, h]
    chunk_states = torch.einsum("bcqh,bcqhp,bcqhn->bchpn", to_end, x, B)
    state = torch.zeros_like(chunk_states[:, 0])
    carried = []
    for c in range(n_chunks):
        carried.append(state)
        state = torch.exp(log_decay[:, c, -1])[..., None, None] * state + chunk_states[:, c]
    entering = torch.stack(carried, dim=1)  # [b, c, h, p, n]: the state as each chunk starts
    across = torch.einsum("bcihn,bchpn->bcihp", C, entering) * torch.exp(log_decay).unsqueeze(-1)
    y = (within + across).reshape(batch, n_chunks * chunk, heads, -1)
    return y[:, :length]


def _one_sequence(zxbcdt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                  dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, *, chunk_size: int,
                  headdim: int, ngroups: int) -> torch.Tensor:
    heads = A.shape[0]
    inner = heads * headdim
    state = (zxbcdt.shape[-1] - 2 * inner - heads) // (2 * ngroups)
    z, xbc, dt = torch.split(zxbcdt, [inner, inner + 2 * ngroups * state, heads], dim=-1)
    xbc = _causal_conv(xbc, conv_weight, conv_bias)
    x, B, C = torch.split(xbc, [inner, ngroups * state, ngroups * state], dim=-1)
    batch, length = x.shape[:2]
    group_of_head = torch.arange(heads, device=x.device) // (heads // ngroups)
    B = B.reshape(batch, length, ngroups, state)[:, :, group_of_head].float()
    C = C.reshape(batch, length, ngroups, state)[:, :, group_of_head].float()
    x_heads = x.reshape(batch, length, heads, headdim)
    dt = F.softplus(dt.float() + dt_bias.float())
    y = _scan(x_heads.float(), dt, A.float(), B, C, chunk_size)
    skip = D.float().reshape(heads, -1) if D.dim() == 2 else D.float().reshape(heads, 1)
    y = y + x_heads.float() * skip
    return (y.reshape(batch, length, inner) * F.silu(z.float())).to(zxbcdt.dtype)


def split_conv1d_scan(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                      dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, chunk_size: int,
                      seq_idx: torch.Tensor | None = None, activation: str = "silu", headdim: int | None = None,
                      ngroups: int = 1, norm_before_gate: bool = False, **unsupported: Any) -> torch.Tensor:
    """``mamba_ssm``'s ``mamba_split_conv1d_scan_combined`` as Megatron's mixer calls it: split
    ``zxbcdt`` ``[b, l, ·]`` into the gate, the convolved ``x, B, C`` and the step sizes, scan, add
    the skip ``D x`` and gate by ``silu(z)``; ``[b, l, heads * headdim]``."""
    extra = {k: v for k, v in unsupported.items() if v is not None}
    if activation != "silu" or extra or norm_before_gate:
        raise NotImplementedError(f"nrl's torch Mamba scan computes Megatron's training call only; got "
                                  f"activation={activation}, norm_before_gate={norm_before_gate}, {sorted(extra)}")
    if headdim is None:  # D per channel: its rows are the heads
        headdim = D.shape[-1] if D.dim() == 2 else D.shape[0] // A.shape[0]
    kwargs = dict(chunk_size=chunk_size, headdim=headdim, ngroups=ngroups)
    if seq_idx is None:
        return _one_sequence(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, **kwargs)
    rows = []
    for row in range(zxbcdt.shape[0]):
        ids = seq_idx[row]
        starts = [0, *(torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist(), ids.shape[0]]
        rows.append(torch.cat([_one_sequence(zxbcdt[row:row + 1, a:b], conv1d_weight, conv1d_bias, dt_bias, A, D,
                                             **kwargs) for a, b in zip(starts[:-1], starts[1:]) if b > a], dim=1))
    return torch.cat(rows, dim=0)


class GatedGroupRMSNorm(torch.nn.Module):
    """``mamba_ssm``'s grouped RMS norm: each group of ``group_size`` channels normalised on its
    own, after the optional gate ``silu(z)`` (Megatron's mixer gates in the scan and norms here)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        if norm_before_gate:
            raise NotImplementedError("nrl's torch gated norm gates before it normalises, as Megatron's mixer does")
        self.eps, self.group_size = eps, group_size or hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if z is None else x.float() * F.silu(z.float())
        groups = x.reshape(*x.shape[:-1], -1, self.group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed.reshape(x.shape) * self.weight.float()).to(dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        """The weight split over tensor-parallel ranks along its one axis, as Megatron's norm saves it."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


def install() -> bool:
    """Give Megatron's mixer the torch scan and norm when ``mamba_ssm`` is absent; returns whether
    they are in use. Idempotent."""
    global _INSTALLED
    import megatron.core.ssm.mamba_mixer as mixer

    if _INSTALLED:
        return True
    if mixer.HAVE_MAMBA_SSM:
        return False
    mixer.ExtendedRMSNorm = GatedGroupRMSNorm
    mixer.mamba_split_conv1d_scan_combined = split_conv1d_scan
    mixer._check_mamba_sequence_packing_support = lambda for_inference_not_training=True: (
        (False, "nrl's torch Mamba scan does not serve Megatron's inference") if for_inference_not_training
        else (True, None))
    mixer.HAVE_MAMBA_SSM = True
    _INSTALLED = True
    return True
