"""The sliding puzzle as an nrl multi-turn environment (NeMo RL's ``sliding_puzzle_game``)."""
