# Sourced by the demo scripts: install (scripts/install.sh), then the environment every demo runs
# nrl in. Sets NRL to the installed command.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/install.sh .venv
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false VLLM_LOGGING_LEVEL=WARNING
NRL=.venv/bin/nrl
