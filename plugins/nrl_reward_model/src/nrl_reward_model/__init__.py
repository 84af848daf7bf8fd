"""nrl-reward-model: Bradley-Terry reward models with NeMo RL's keys, trained (``nrl train rm``) and
used as a reward environment (``env.reward_model``), as a plugin of nrl's public hooks."""

__version__ = "0.2.0"
