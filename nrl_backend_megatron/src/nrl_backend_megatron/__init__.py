"""nrl's Megatron-Core training backend (``policy.megatron_cfg``).

Importing this package is cheap: ``plugin`` and ``schema`` never import torch or megatron, so
listing plugins or validating a config stays fast. The worker and its helpers import them lazily;
where torch is built without CUDA, Megatron-Core's fused functions then compile on first call (compile_on_call).
"""

from nrl_backend_megatron import compile_on_call

compile_on_call.install()

__version__ = "0.16.0"
