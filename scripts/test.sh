#!/usr/bin/env bash
# Install everything (scripts/install.sh), lint (ruff, and import-linter's contracts in
# .importlinter), then the test suite; with --quick first, only the quick tier (the `quick` marker:
# every distribution's unit tests and one short end-to-end run per algorithm). Tests run on NRL_TEST_WORKERS pytest-xdist workers (default 2; 0 runs them in this
# process). Other arguments go to pytest. docs/testing.md says what each tier covers and takes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh .venv
.venv/bin/ruff check --quiet .
.venv/bin/lint-imports --no-cache --no-logo
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false NRL_STRICT_PLUGINS=1
tier=()
if [ "${1:-}" = --quick ]; then
  shift
  tier=(-m quick)
fi
workers=()
if [ "${NRL_TEST_WORKERS:-2}" != 0 ]; then
  workers=(-n "${NRL_TEST_WORKERS:-2}" --dist loadgroup)
fi
exec .venv/bin/python -m pytest "${workers[@]}" "${tier[@]}" "$@"
