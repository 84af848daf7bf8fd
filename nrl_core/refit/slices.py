"""Parts of tensors: what one engine rank loads of a refit tensor, and the tensor it is handed.

Under tensor parallelism each rank of an engine loads a block of most weights: its rows of a
column-parallel matrix, its columns of a row-parallel one, its share of the vocabulary. A rank
that declares ``sliced_import`` names that block (:class:`WeightSlice`, a box of index ranges, one
per dimension) in ``refit_wants``, and every transport then moves only the block to it: the
broadcast transport cuts it out before it sends, shared memory hands a view of it.

The engine's loaders are written for whole checkpoint tensors (they narrow them to their rank's
part themselves), so the rank is handed an :class:`OwnedRegion`: a tensor of the whole shape that
holds only the block. Slicing it is free; reading from it (a copy, a conversion, any arithmetic)
works inside the block and raises :class:`~nrl_core.refit.manifest.RefitError` outside it, so a
rank that named too little fails loudly instead of loading memory it never received.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nrl_core.refit.manifest import RefitError

if TYPE_CHECKING:
    import torch

    from nrl_core.contracts import WeightSpec

__all__ = ["OwnedRegion", "Region", "WeightSlice", "as_owned", "cut", "region_nbytes", "region_shape"]

Region = tuple[tuple[int, int], ...]
"""One ``(start, stop)`` per dimension: the box ``tensor[start0:stop0, start1:stop1, ...]``."""


@dataclass(frozen=True)
class WeightSlice:
    """A block of one manifest tensor that an engine rank loads (``sliced_import``); ``region``
    holds one ``(start, stop)`` per dimension of the tensor."""

    name: str
    region: Region

    def __post_init__(self) -> None:
        object.__setattr__(self, "region", tuple((int(a), int(b)) for a, b in self.region))


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in region)


def region_nbytes(region: Region, element_size: int) -> int:
    n = element_size
    for size in region_shape(region):
        n *= size
    return n


def is_whole(region: Region, shape: Sequence[int]) -> bool:
    return all(start == 0 and stop == size for (start, stop), size in zip(region, shape))


def check_slice(entry: WeightSlice, spec: WeightSpec, who: str) -> None:
    """Refuse, before anything is sent, a slice that is not a box inside its tensor."""
    shape = tuple(spec.shape)
    if len(entry.region) != len(shape) or any(not 0 <= a <= b <= size for (a, b), size in zip(entry.region, shape)):
        raise RefitError(f"refit rejected, weights unchanged; {who} asks for {entry.name}{list(entry.region)}, "
                         f"which is not a block of its shape {list(shape)} (refit_wants must name (start, stop) "
                         f"inside each dimension)", extra=[entry.name])


def cut(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    """The view of ``tensor``'s block ``region`` (no copy)."""
    return tensor[tuple(slice(start, stop) for start, stop in region)]


def _outside(name: str, what: str) -> RefitError:
    return RefitError(f"refit failed: this engine rank read {name} outside the block it named in refit_wants "
                      f"({what}); its loaders read more than it named, and the next refit sends it whole",
                      extra=[name])


def _owned_region_class() -> type:
    import torch

    aten = torch.ops.aten

    class _OwnedRegion(torch.Tensor):
        """A tensor of a refit tensor's whole shape holding one block of it (see the module)."""

        weight_name: str
        part: torch.Tensor | None  # the block; None when the view owns none of itself
        region: Region  # in this view's own coordinates

        @staticmethod
        def __new__(cls, name: str, part: torch.Tensor | None, region: Region, shape: Sequence[int],
                    like: torch.Tensor) -> Any:
            wrapper = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=like.dtype, device=like.device,
                                                          requires_grad=False)
            wrapper.weight_name, wrapper.part, wrapper.region = name, part, region
            return wrapper

        __torch_function__ = torch._C._disabled_torch_function_impl

        def __repr__(self) -> str:
            return f"OwnedRegion({self.weight_name}, shape={list(self.shape)}, owns={list(self.region)})"

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in (aten.alias.default, aten.detach.default) or \
                    (func is aten.view.default and tuple(args[1]) == tuple(args[0].shape)):
                self = args[0]
                return _OwnedRegion(self.weight_name, self.part, self.region, self.shape, self)
            if func is aten.slice.Tensor:
                return _slice(*args, **kwargs)
            if func is aten.select.int:
                return _select(*args, **kwargs)
            if func in (aten.split.Tensor, aten.split_with_sizes.default):
                return _split(func, *args, **kwargs)
            if func is aten.unbind.int:
                self, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
                return [_select(self, dim, i) for i in range(self.shape[dim])]
            if func is aten.unsqueeze.default:
                self, dim = args[0], args[1] % (args[0].dim() + 1)
                return _moved(self, lambda t: t.unsqueeze(dim), [*range(dim), None, *range(dim, self.dim())])
            if func in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
                self = args[0]
                dims = range(self.dim()) if len(args) < 2 else [args[1]] if isinstance(args[1], int) else args[1]
                gone = {d % self.dim() for d in dims if self.shape[d] == 1}
                return _moved(self, lambda t: t.squeeze(tuple(gone)) if gone else t,
                              [d for d in range(self.dim()) if d not in gone])
            if func in (aten.transpose.int, aten.t.default, aten.permute.default):
                self = args[0]
                order = list(range(self.dim()))
                if func is aten.permute.default:
                    order = [d % self.dim() for d in args[1]]
                elif self.dim() == 2 or func is aten.transpose.int:
                    a, b = (0, 1) if func is aten.t.default else (args[1] % self.dim(), args[2] % self.dim())
                    order[a], order[b] = order[b], order[a]
                return _moved(self, lambda t: t.permute(order), order)
            wrapped = [a for a in (*args, *kwargs.values()) if isinstance(a, cls)]
            if all(a.numel() == 0 for a in wrapped):
                def unwrap(a: Any) -> Any:
                    return torch.empty(a.shape, dtype=a.dtype, device=a.device) if isinstance(a, cls) else a
                return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})
            raise _outside(wrapped[0].weight_name, f"through {func}")

        def _view(self, dim: int, start: int, stop: int) -> Any:
            """``self[..., start:stop, ...]`` along ``dim``: the block part of it, a plain tensor
            when the view lies inside the block."""
            shape = list(self.shape)
            shape[dim] = stop - start
            if self.part is None:
                return _OwnedRegion(self.weight_name, None, (), shape, self)
            a, b = self.region[dim]
            lo, hi = max(a, start), min(b, stop)
            if lo >= hi and stop > start:
                return _OwnedRegion(self.weight_name, None, (), shape, self)
            part = self.part.narrow(dim, lo - a, max(hi - lo, 0))
            region = list(self.region)
            region[dim] = (lo - start, max(hi, lo) - start)
            if is_whole(tuple(region), shape):
                return part
            return _OwnedRegion(self.weight_name, part, tuple(region), shape, self)

    def _moved(self: Any, on_part: Any, order: list[int | None]) -> Any:
        """``self`` with its dimensions rearranged: dimension ``i`` of the result is ``order[i]``
        of ``self`` (None: a new one of size 1); ``on_part`` does the same to the block."""
        shape = [1 if d is None else self.shape[d] for d in order]
        if self.part is None:
            return _OwnedRegion(self.weight_name, None, (), shape, self)
        region = tuple((0, 1) if d is None else self.region[d] for d in order)
        part = on_part(self.part)
        return part if is_whole(region, shape) else _OwnedRegion(self.weight_name, part, region, shape, self)

    def _slice(self: Any, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1) -> Any:
        size = self.shape[dim]
        dim = dim % self.dim()
        start = 0 if start is None else max(0, min(size, start + size if start < 0 else start))
        end = size if end is None else max(start, min(size, end + size if end < 0 else end))
        if step != 1:
            raise _outside(self.weight_name, f"a slice with step {step}")
        return self._view(dim, start, end)

    def _select(self: Any, dim: int, index: int) -> Any:
        dim = dim % self.dim()
        index = index + self.shape[dim] if index < 0 else index
        view = self._view(dim, index, index + 1)
        if isinstance(view, _OwnedRegion):
            shape = [s for i, s in enumerate(view.shape) if i != dim]
            if view.part is None:
                return _OwnedRegion(view.weight_name, None, (), shape, view)
            region = tuple(r for i, r in enumerate(view.region) if i != dim)
            return _OwnedRegion(view.weight_name, view.part.squeeze(dim), region, shape, view)
        return view.squeeze(dim)

    def _split(func: Any, self: Any, sizes: Any, dim: int = 0) -> list[Any]:
        dim = dim % self.dim()
        total = self.shape[dim]
        if func is aten.split.Tensor:
            sizes = [min(sizes, total - i) for i in range(0, total, sizes)] if sizes else [total]
        pieces, start = [], 0
        for size in sizes:
            pieces.append(self._view(dim, start, start + size))
            start += size
        return pieces

    return _OwnedRegion


_CLASS: dict[str, type] = {}


def _owned_class() -> type:
    if "cls" not in _CLASS:
        _CLASS["cls"] = _owned_region_class()
    return _CLASS["cls"]


def OwnedRegion(name: str, block: torch.Tensor, region: Region, shape: Sequence[int]) -> Any:  # noqa: N802
    """A tensor of ``shape`` that holds ``block`` at ``region`` and refuses reads outside it; the
    block itself when it is the whole tensor."""
    if is_whole(region, shape):
        return block
    if tuple(block.shape) != region_shape(region):
        raise RefitError(f"refit rejected: {name} arrived as {list(block.shape)}, not the block {list(region)} "
                         f"this rank named", extra=[name])
    return _owned_class()(name, block, tuple(region), tuple(shape), block)


def is_owned_region(tensor: Any) -> bool:
    return "cls" in _CLASS and isinstance(tensor, _CLASS["cls"])


def as_owned(buckets: Iterable[list[tuple[str, torch.Tensor]]], slices: Mapping[str, Region],
             shapes: Mapping[str, Sequence[int]]) -> Iterator[list[tuple[str, Any]]]:
    """The buckets with each tensor named in ``slices`` handed as an :class:`OwnedRegion` of its
    manifest shape (``shapes``). A transport may deliver the block or the whole tensor (one that
    cannot cut); anything else is refused before the bucket reaches the engine."""
    # a map keeps no bucket between items: one kept while the next is received would hold its buffer
    return map(lambda bucket: [(name, _owned(name, tensor, slices, shapes)) for name, tensor in bucket], buckets)


def _owned(name: str, tensor: torch.Tensor, slices: Mapping[str, Region], shapes: Mapping[str, Sequence[int]]) -> Any:
    region = slices.get(name)
    if region is None or name not in shapes:
        return tensor
    shape = tuple(shapes[name])
    if tuple(tensor.shape) == shape and not is_whole(region, shape):
        tensor = cut(tensor, region)
    return OwnedRegion(name, tensor, region, shape)
