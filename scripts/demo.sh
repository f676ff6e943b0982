#!/usr/bin/env bash
# The proxy's main job on an embedded default: fake vLLM prefill and decode instances (no GPU)
# that announce themselves to the proxy, the proxy on $PORT (default 10001), and curl commands to
# try. Serves until Ctrl-C, then stops everything it started.
#
#   scripts/demo.sh            NIXL proxy (nixl_proxy.py)
#   scripts/demo.sh moriio     MoRIIO proxy (moriio_proxy.py), READ mode
#   scripts/demo.sh moriio-write   MoRIIO proxy, WRITE mode
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-nixl}"
PORT="${PORT:-10001}"
case "$mode" in
    nixl|moriio|moriio-write) ;;
    *) echo "usage: scripts/demo.sh [nixl|moriio|moriio-write]" >&2; exit 2 ;;
esac

if [ ! -x .venv/bin/python ]; then
    echo "creating .venv ..."
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
py=.venv/bin/python

free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
if ! "$py" -c "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', $PORT))" 2>/dev/null; then
    echo "port $PORT is taken: run PORT=<another port> scripts/demo.sh" >&2
    exit 1
fi
disc_port="$(free_port)"
tmp="$(mktemp -d)"
pids=()
cleanup() {
    trap - INT TERM EXIT
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$tmp"
    echo "demo stopped"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ "$mode" = nixl ]; then
    "$py" nixl_proxy.py --host 127.0.0.1 --port "$PORT" --discovery-host 127.0.0.1 \
        --discovery-port "$disc_port" &
    pids+=($!)
    fake_args=(--connector nixl --dialect moriio)
else
    tm=READ; [ "$mode" = moriio-write ] && tm=WRITE
    "$py" moriio_proxy.py --host 127.0.0.1 --port "$PORT" --discovery-host 127.0.0.1 \
        --discovery-port "$disc_port" &
    pids+=($!)
    fake_args=(--connector moriio --dialect moriio --transfer-mode "$tm")
fi
for role in P D; do
    FAKE_VLLM_LOG=WARNING "$py" scripts/fake_vllm.py --port 0 --port-file "$tmp/$role" \
        --role "$role" --announce "127.0.0.1:$disc_port" --announce-interval 1 \
        --prefill-latency-ms 20 --token-latency-ms 40 "${fake_args[@]}" &
    pids+=($!)
done

for _ in $(seq 1 150); do
    if "$py" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; then
        break
    fi
    for pid in "${pids[@]}"; do
        kill -0 "$pid" 2>/dev/null || { echo "a demo process exited early" >&2; exit 1; }
    done
    sleep 0.2
done
"$py" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" \
    || { echo "the proxy did not become healthy" >&2; exit 1; }

url="http://127.0.0.1:$PORT"
cat <<TXT

The $mode proxy is serving on $url with fake prefill (port $(cat "$tmp/P")) and decode
(port $(cat "$tmp/D")) instances that announced themselves on discovery port $disc_port.
Try, in another terminal:

  curl -s $url/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "fake-model", "prompt": "Hello, my name is", "max_tokens": 8}'

  curl -s $url/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}'

  curl -sN $url/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "fake-model", "prompt": "Stream this", "max_tokens": 8, "stream": true}'

  curl -s $url/healthcheck ; curl -s $url/instances ; curl -s $url/metrics

Press Ctrl-C to stop.
TXT
wait "${pids[0]}"
