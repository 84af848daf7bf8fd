#!/usr/bin/env bash
# Install everything (scripts/install.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh .venv
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false NRL_STRICT_PLUGINS=1
exec .venv/bin/python -m pytest tests "$@"
