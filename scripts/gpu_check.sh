#!/usr/bin/env bash
# The GPU acceptance run, on a machine where only PyTorch is installed (Python 3.11 or 3.12):
#   backends  benchmarks/gpu/gpu_check.py: DTensor FSDP2 and Megatron-Core through the core's code
#             paths in bf16 on a 0.69B Llama built locally (packed logprobs vs HF fp32, reference
#             pass, GRPO's loss with KL, checkpoint round trip, weight export, offload measured with
#             mem_get_info) and a Qwen3-MoE model; torch.multiprocessing ranks, no Ray.
#   grpo      benchmarks/gpu/grpo_check.py: `nrl train sft` then `nrl train grpo` on one GPU with
#             Ray, the DTensor backend and rollouts from nrl-gen-hf; passes when the reward rises.
#   refit     benchmarks/gpu/refit_check.py: a part of weights handed to a second process on the GPU
#             lent by CUDA IPC handle against through /dev/shm (GB/s), and a one-rank NCCL refit
#             group made and destroyed 50 times (seconds; threads, descriptors, device memory).
#
#   scripts/gpu_check.sh [--wheels DIR] [--out DIR] [--parts refit,backends,grpo] [--dry-run]
#   scripts/gpu_check.sh --download-wheels DIR   # where pip reaches an index: the wheels a bare machine needs
#
# --wheels DIR installs every wheel in DIR (no index, no dependency resolution: DIR holds what the
# machine lacks) and this checkout's distributions, editable, into the interpreter's environment
# ($PYTHON, default python3): meant for a disposable GPU machine. The grpo part needs the editable
# install (plugins are found through their entry points); the backends part runs from the checkout.
# Parts run in the order given. Each has a time limit (NRL_GPU_CHECK_REFIT_S, NRL_GPU_CHECK_BACKENDS_S, NRL_GPU_CHECK_GRPO_S)
# so that one hang still leaves the other's result; NRL_GPU_CHECK_GRPO_STEPS sets GRPO's steps, and
# NRL_GPU_CHECK_ONLY (e.g. megatron) and NRL_GPU_CHECK_MODELS (dense, moe) narrow the backends part. Results: DIR/backends.json, DIR/grpo.json. Exit status: 0 every
# check passed, 1 one failed, 2 no GPU (use --dry-run for the CPU path). Results also: DIR/refit.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DISTS=(. nrl_backend_dtensor nrl_backend_megatron plugins/nrl_gen_hf plugins/nrl_env_math)

if [[ "${1:-}" == "--download-wheels" ]]; then
  set -e
  dir="${2:?usage: scripts/gpu_check.sh --download-wheels DIR}"
  mkdir -p "$dir"
  "$PY" benchmarks/gpu/requirements.py > "$dir/requirements.txt"
  for version in 3.11 3.12; do
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$dir/full" -r "$dir/requirements.txt"
  done
  for wheel in "$dir"/full/*.whl; do  # Ray without its Java worker and dashboard bundle
    case "$(basename "$wheel")" in
      ray-*) "$PY" benchmarks/gpu/slim_wheel.py "$wheel" "$dir" >/dev/null ;;
      *) mv "$wheel" "$dir/" ;;
    esac
  done
  rm -rf "$dir/full"
  echo "wheels for Python 3.11 and 3.12 in $dir; keep one Python's wheels, drop what the GPU machine already has,"
  echo "carry the folder there and run: scripts/gpu_check.sh --wheels $dir"
  exit 0
fi

wheels="" out="" parts="refit,backends,grpo" dry=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) wheels="${2:?--wheels DIR}"; shift 2 ;;
    --out) out="${2:?--out DIR}"; shift 2 ;;
    --parts) parts="${2:?--parts refit,backends,grpo}"; shift 2 ;;
    --dry-run) dry=(--dry-run); shift ;;
    *) echo "gpu_check: unknown argument $1 (see the header of scripts/gpu_check.sh)" >&2; exit 64 ;;
  esac
done
out="${out:-results/gpu_check}"
mkdir -p "$out"

if [[ -n "$wheels" ]]; then
  shopt -s nullglob
  found=("$wheels"/*.whl)
  if ((${#found[@]})); then
    "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check "${found[@]}" || exit 1
  fi
  editable=()
  for dist in "${DISTS[@]}"; do editable+=(-e "$dist"); done
  "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation --ignore-requires-python \
    --disable-pip-version-check "${editable[@]}" || exit 1
fi

export PYTHONPATH="$PWD:$PWD/nrl_backend_dtensor/src:$PWD/nrl_backend_megatron/src:$PWD/plugins/nrl_gen_hf/src:$PWD/plugins/nrl_env_math/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
status=0
IFS=, read -r -a order <<< "$parts"
for part in "${order[@]}"; do
  case "$part" in
    refit)
      timeout --kill-after=10 "${NRL_GPU_CHECK_REFIT_S:-300}" "$PY" benchmarks/gpu/refit_check.py "${dry[@]}" \
        --out "$out/refit.json"
      code=$?
      ((code == 124)) && echo "refit: FAIL timed out after ${NRL_GPU_CHECK_REFIT_S:-300} s"
      ((code == 2)) && exit 2 ;;
    backends)
      timeout --kill-after=10 "${NRL_GPU_CHECK_BACKENDS_S:-900}" "$PY" benchmarks/gpu/gpu_check.py "${dry[@]}" \
        --backends "${NRL_GPU_CHECK_ONLY:-dtensor,megatron}" --models "${NRL_GPU_CHECK_MODELS:-dense,moe}" \
        --out "$out/backends.json"
      code=$?
      ((code == 124)) && echo "backends: FAIL timed out after ${NRL_GPU_CHECK_BACKENDS_S:-900} s (partial results in $out/backends.json)"
      ((code == 2)) && exit 2 ;;
    grpo)
      timeout --kill-after=10 "${NRL_GPU_CHECK_GRPO_S:-900}" "$PY" benchmarks/gpu/grpo_check.py "${dry[@]}" \
        ${NRL_GPU_CHECK_GRPO_STEPS:+--steps "$NRL_GPU_CHECK_GRPO_STEPS"} --out "$out/grpo.json" --workdir "$out/grpo_run"
      code=$?
      ((code == 124)) && echo "grpo: FAIL timed out after ${NRL_GPU_CHECK_GRPO_S:-900} s (its logs: $out/grpo_run/*.log)" ;;
    *) echo "gpu_check: unknown part '$part' (refit, backends, grpo)" >&2; exit 64 ;;
  esac
  ((code)) && status=1
done
exit $status
