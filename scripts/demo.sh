#!/usr/bin/env bash
# Install everything (scripts/install.sh), then the main job on this machine's CPU:
# build a tiny Llama and tokenizer locally, SFT warm start on arithmetic, then GRPO with the math
# environment (DTensor training, vLLM generation colocated). Outputs go to results/demo/.
set -euo pipefail
source "$(dirname "$0")/demo_env.sh"
rm -rf results/demo
$NRL tiny-model results/demo/base --family llama --size small --seed 0
$NRL train sft --config examples/configs/sft_tiny_cpu.yaml "$@"
$NRL train grpo --config examples/configs/grpo_tiny_cpu.yaml "$@"
.venv/bin/python - <<'PY'
import json
rows = [json.loads(line) for line in open("results/demo/grpo/logs/metrics.jsonl")]
val = [r for r in rows if "val/accuracy" in r]
print(f"\nvalidation accuracy (greedy, {len(val)} evaluations): after SFT {val[0]['val/accuracy']:.3f} "
      f"(step {val[0]['step']}), after GRPO {val[-1]['val/accuracy']:.3f} (step {val[-1]['step']})")
print("metrics:     results/demo/grpo/logs/metrics.jsonl (TensorBoard: results/demo/grpo/logs/tensorboard)")
print("plot:        results/demo/grpo/logs/metrics.png")
print("checkpoints: results/demo/grpo (SFT: results/demo/sft)")
print("HF export:   results/demo/grpo/hf_export")
PY
