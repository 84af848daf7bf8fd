"""nrl's Megatron-Core training backend (``policy.megatron_cfg``).

Importing this package is cheap: ``plugin`` and ``schema`` never import torch or megatron, so
listing plugins or validating a config stays fast. The worker and its helpers import them lazily.
"""

__version__ = "0.15.0"
