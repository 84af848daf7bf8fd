#!/usr/bin/env bash
# The GPU check (benchmarks/gpu/gpu_check.py) on a machine where only PyTorch is installed:
# DTensor FSDP2 and Megatron-Core training steps (bf16, NCCL, every visible GPU) on a small model
# built locally, logprobs against HF, tokens/s and MFU, device memory given back by offload (mem_get_info).
#
#   scripts/gpu_check.sh [--wheels DIR] [--dry-run] [--out FILE] [--world N] [--backends dtensor,megatron]
#   scripts/gpu_check.sh --download-wheels DIR   # where pip can reach an index: fill DIR for Python 3.11 and 3.12
#
# --wheels DIR installs megatron-core, transformers and the pure-Python packages nrl imports from DIR
# (no network) into .venv-gpu-check, a venv that sees the system's PyTorch (--system-site-packages).
# Without it the interpreter ($PYTHON, default python3) must already have them. The project itself is
# used from this checkout through PYTHONPATH; Ray and vLLM are never imported. Exit status: 0 all
# checks passed, 1 a check failed, 2 no GPU (use --dry-run for the CPU path).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--download-wheels" ]]; then
  dir="${2:?usage: scripts/gpu_check.sh --download-wheels DIR}"
  mkdir -p "$dir"
  "$PY" benchmarks/gpu/requirements.py > "$dir/requirements.txt"
  for version in 3.11 3.12; do
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$dir" -r "$dir/requirements.txt"
  done
  echo "wheels for Python 3.11 and 3.12 in $dir; carry it to the GPU machine and run: scripts/gpu_check.sh --wheels $dir"
  exit 0
fi

if [[ "${1:-}" == "--wheels" ]]; then
  dir="${2:?usage: scripts/gpu_check.sh --wheels DIR [arguments]}"
  shift 2
  venv=.venv-gpu-check
  [[ -x "$venv/bin/python" ]] || "$PY" -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install --quiet --no-index --find-links "$dir" -r "$dir/requirements.txt"
  PY="$venv/bin/python"
fi

export PYTHONPATH="$PWD:$PWD/nrl_backend_dtensor/src:$PWD/nrl_backend_megatron/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false
exec "$PY" benchmarks/gpu/gpu_check.py "$@"
