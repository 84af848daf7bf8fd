"""The engine's model as the target of a refit: which tensors it must receive, and loading them.

Refits carry tensors in the checkpoint's layout (:func:`nrl_core.refit.hf_source.checkpoint_layout`:
one tensor per expert where transformers fuses a MoE layer's experts in memory). The engine checks
a refit against that layout of its own model, so a training backend that names or shapes weights
wrongly and consistently (manifest and tensors alike) is refused before anything is loaded, and
then writes each tensor into the parameter that holds it: in place for tensors stored as they are,
through an index map for fused ones (transformers' reverse conversion applied to positions rather
than values tells where every element of a checkpoint tensor lives in the fused parameter).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from nrl_core.api import WeightSpec, checkpoint_layout
from nrl_core.api import verify_manifest as verify

if TYPE_CHECKING:
    import torch


class RefitLayout:
    """The checkpoint-layout view of one model's weights."""

    def __init__(self, model: Any) -> None:
        self.model = model
        state = {name: tensor.to("meta") for name, tensor in model.state_dict().items()}
        self.shapes = {name: tuple(int(d) for d in t.shape) for name, t in checkpoint_layout(model, state)}
        self.fused: dict[str, str] = {}  # checkpoint name -> the fused parameter holding it
        for name in state.keys() - self.shapes.keys():
            for piece in self._revert(name, state[name]):
                self.fused[piece] = name
        self.optional = self._tied_names()

    def _revert(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        return dict(revert_weight_conversion(self.model, {name: tensor}))

    def _tied_names(self) -> set[str]:
        """Names whose tensor another name already holds (tied embeddings): a checkpoint may leave
        them out, and loading the first one loads them too."""
        seen: set[int] = set()
        tied = set()
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            key = id(tensor)
            if key in seen and name in self.shapes:
                tied.add(name)
            seen.add(key)
        return tied

    def check(self, manifest: list[WeightSpec]) -> None:
        """Raise :class:`~nrl_core.refit.manifest.RefitError` unless ``manifest`` names exactly this
        model's checkpoint tensors, with their shapes (dtypes are the refit's choice)."""
        sent = {spec.name: spec for spec in manifest}
        expected = [WeightSpec(name=name, shape=shape, dtype=sent[name].dtype if name in sent else "any")
                    for name, shape in self.shapes.items() if name not in self.optional or name in sent]
        verify(manifest, expected, what="refit into the hf engine's model")

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checked tensors into the model (cast to its dtype and device)."""
        import torch

        params = self.model.state_dict()  # detached, sharing storage with the parameters
        fused: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for name, tensor in named:
                owner = self.fused.get(name)
                if owner is None:
                    params[name].copy_(tensor)
                else:
                    fused.setdefault(owner, {})[name] = tensor
            for owner, pieces in fused.items():
                target = params[owner]
                flat = target.view(-1)
                positions = torch.arange(target.numel(), device=target.device).view(target.shape)
                for piece, index in self._revert(owner, positions).items():
                    flat[index.reshape(-1)] = pieces[piece].reshape(-1).to(device=target.device, dtype=target.dtype)
