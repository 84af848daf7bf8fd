#!/usr/bin/env bash
# Create TRL's own virtual environment for benchmarks/bench_grpo_vs_trl.py (TRL is not a dependency
# of nrl and never enters nrl's venv). Same torch and transformers as nrl (requirements/cpu.txt),
# so both frameworks run the same kernels; TRL 1.16.0 with HF generate (no vLLM extra).
# Idempotent. Usage: benchmarks/trl/make_venv.sh [venv-dir]   (default benchmarks/.venv-trl)
# TORCH_INDEX: where the CPU build of torch comes from (default PyTorch's CPU index; set it empty
# when a local wheel is on pip's find-links, as on the project machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-benchmarks/.venv-trl}"
PYTHON="${PYTHON:-python3.11}"
TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
pin() { grep -E "^$1==" requirements/cpu.txt; }  # nrl's pin of a package shared with TRL
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$(pin torch)+cpu"
"${PIP[@]}" install --quiet "$(pin torch)+cpu" "$(pin transformers)" "$(pin tokenizers)" "$(pin safetensors)" \
  "$(pin datasets)" "$(pin numpy)" "$(pin PyYAML)" "$(pin math-verify)" trl==1.16.0 accelerate==1.15.0 psutil
"$VENV/bin/python" -c 'import torch, transformers, trl; print("TRL venv ready:", torch.__version__, "transformers", transformers.__version__, "trl", trl.__version__)'
