"""nrl-algo-ppo: PPO with a value model, NeMo RL's keys, as a plugin of nrl's public hooks."""

__version__ = "0.5.0"
