#!/usr/bin/env bash
# The CPU twin of NeMo RL's grpo_sliding_puzzle.yaml: a tiny Llama, a short SFT on first moves of
# 2x2 boards, then 20 multi-turn GRPO steps with the sliding-puzzle environment
# (nrl-env-sliding-puzzle), and the training reward of the first and last five steps.
# Outputs go to results/sliding_puzzle/. Extra arguments go to every `nrl train`.
set -euo pipefail
source "$(dirname "$0")/demo_env.sh"
rm -rf results/sliding_puzzle
$NRL tiny-model results/sliding_puzzle/base --family llama --size small --seed 0
$NRL train sft --config examples/configs/sliding_puzzle_sft_tiny_cpu.yaml "$@"
$NRL train grpo --config examples/configs/grpo_sliding_puzzle_tiny_cpu.yaml "$@"
.venv/bin/python -m nrl_core.logging.compare results/sliding_puzzle/grpo/logs --labels sliding-puzzle
