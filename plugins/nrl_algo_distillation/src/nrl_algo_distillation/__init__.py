"""nrl-algo-distillation: on-policy distillation with NeMo RL's keys, as a plugin of nrl's public hooks."""

__version__ = "0.3.0"
