"""NeMo RL's named datasets and prompt processors, registered with nrl through its hooks."""
