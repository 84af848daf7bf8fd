"""Our own HF ↔ Megatron-Core conversion (Megatron-Bridge cannot be installed beside this stack)."""

from nrl_backend_megatron.convert.families import FAMILIES, Family, family_of
from nrl_backend_megatron.convert.mapping import (
    canonical_shapes,
    hf_to_megatron,
    megatron_to_hf,
    megatron_to_hf_items,
    megatron_to_hf_stream,
)

__all__ = ["FAMILIES", "Family", "family_of", "canonical_shapes", "hf_to_megatron", "megatron_to_hf",
           "megatron_to_hf_items", "megatron_to_hf_stream"]
