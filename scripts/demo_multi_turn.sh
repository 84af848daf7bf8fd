#!/usr/bin/env bash
# The multi-turn demo on this machine's CPU: a tiny Llama learns to use a tool. SFT on tool-use
# traces (call lookup, read the result, answer), then multi-turn GRPO with the kv_lookup
# environment, whose values are drawn per episode so only the tool can tell them; then the same
# GRPO with one turn per episode (no turn to read the tool's result in) as the baseline. Every
# baseline reward is 0, so its advantages are 0 and its weights never move: ten steps show it.
# Outputs go to results/demo_multi_turn/. Extra arguments go to every `nrl train`.
set -euo pipefail
source "$(dirname "$0")/demo_env.sh"
OUT=results/demo_multi_turn
rm -rf "$OUT"
$NRL tiny-model "$OUT/base" --family llama --size small --seed 0
$NRL train sft --config examples/configs/kv_lookup_sft_tiny_cpu.yaml "$@"
$NRL train grpo --config examples/configs/kv_lookup_grpo_tiny_cpu.yaml "$@"
$NRL train grpo --config examples/configs/kv_lookup_grpo_tiny_cpu.yaml grpo.max_rollout_turns=1 \
  grpo.max_num_steps=10 checkpointing.checkpoint_dir="$OUT/single_turn" logger.log_dir="$OUT/single_turn/logs" "$@"
.venv/bin/python -m nrl_core.logging.compare "$OUT/grpo/logs" "$OUT/single_turn/logs" \
  --labels multi-turn single-turn --out "$OUT/comparison.png"
