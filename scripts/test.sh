#!/usr/bin/env bash
# The test command: creates .venv, installs the pinned requirements, then lints, type-checks
# and runs the test suite. Extra arguments go to pytest (e.g. scripts/test.sh -k nixl).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
echo "== ruff"
.venv/bin/ruff check .
echo "== mypy --strict"
.venv/bin/mypy registry.py relay.py nixl_proxy.py $(ls moriio_proxy.py 2>/dev/null) scripts/ tests/
echo "== pytest"
.venv/bin/python -m pytest "$@"
