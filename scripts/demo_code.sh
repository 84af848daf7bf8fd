#!/usr/bin/env bash
# Code RL on this machine's CPU: a tiny Llama, SFT on generated code tasks, then GRPO with the
# code environment (nrl-env-code: every program runs against its task's tests in a sandbox), once
# on each training backend (DTensor, then Megatron-Core) from the same SFT model; then the
# training reward of the first and last steps of each. Outputs go to results/code/. Extra
# arguments go to every `nrl train`.
set -euo pipefail
source "$(dirname "$0")/demo_env.sh"
OUT=results/code
rm -rf "$OUT"
$NRL tiny-model "$OUT/base" --family llama --size small --seed 0
$NRL train sft --config examples/configs/code_sft_tiny_cpu.yaml "$@"
$NRL train grpo --config examples/configs/grpo_code_tiny_cpu.yaml checkpointing.checkpoint_dir="$OUT/grpo_dtensor" \
  logger.log_dir="$OUT/grpo_dtensor/logs" "$@"
$NRL train grpo --config examples/configs/grpo_code_tiny_cpu.yaml policy.dtensor_config.enabled=false \
  policy.megatron_cfg.enabled=true policy.optimizer=null policy.megatron_cfg.optimizer.lr=3.0e-4 \
  policy.megatron_cfg.optimizer.min_lr=3.0e-4 policy.megatron_cfg.optimizer.weight_decay=0.0 \
  policy.megatron_cfg.optimizer.adam_beta2=0.99 policy.megatron_cfg.scheduler.lr_warmup_iters=0 \
  checkpointing.checkpoint_dir="$OUT/grpo_megatron" logger.log_dir="$OUT/grpo_megatron/logs" "$@"
.venv/bin/python -m nrl_core.logging.compare "$OUT/grpo_dtensor/logs" "$OUT/grpo_megatron/logs" \
  --labels dtensor megatron --out "$OUT/comparison.png"
