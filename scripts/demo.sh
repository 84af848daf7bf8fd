#!/usr/bin/env bash
# Install everything (scripts/install.sh) and run the main job on a tiny CPU model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh .venv
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TOKENIZERS_PARALLELISM=false
.venv/bin/nrl plugins
.venv/bin/nrl config check examples/configs/grpo_math_1B.yaml
.venv/bin/nrl config check examples/configs/grpo_math_1B_megatron.yaml
