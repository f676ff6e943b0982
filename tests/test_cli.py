"""Command lines: flag validation, and the scripts run as real processes."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

import nixl_proxy
from conftest import bound_socket, wait_for
from fake_vllm import FakeVLLM

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("argv", "message"), [
    (["--prefiller-hosts", "a", "b", "--prefiller-ports", "1", "--decoder-host", "c",
      "--decoder-port", "2"], "--prefiller-hosts has 2 values but --prefiller-ports has 1"),
    (["--prefiller-host", "a", "--prefiller-port", "1"], "give at least one prefiller and one"),
    ([], "give at least one prefiller"),
    (["--port", "abc", "--discovery-port", "5"], "not a TCP port"),
    (["--port", "70000", "--discovery-port", "5"], "not a TCP port"),
    (["--discovery-port", "5", "--instance-ttl", "0"], "must be greater than 0"),
    (["--discovery-port", "5", "--instance-ttl", "x"], "not a number"),
    (["--discovery-port", "5", "--policy", "random"], "invalid choice"),
    (["--discovery-port", "5", "--log-level", "loud"], "invalid choice"),
])
def test_bad_flags_are_usage_errors(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        nixl_proxy.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_toy_proxy_command_line_is_accepted() -> None:
    s = nixl_proxy.parse_args([
        "--port", "8192", "--prefiller-hosts", "10.0.0.1", "10.0.0.2", "--prefiller-ports",
        "8100", "8101", "--decoder-host", "::1", "--decoder-port", "8200",
        "--log-level", "debug", "--policy", "least_loaded"])
    assert s.port == 8192 and s.host == "127.0.0.1"
    assert s.prefill_urls == ("http://10.0.0.1:8100/v1", "http://10.0.0.2:8101/v1")
    assert s.decode_urls == ("http://[::1]:8200/v1",)
    assert s.discovery_port is None and s.log_level == "DEBUG"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_proxy_process_serves_and_stops_on_sigterm(fake_p: FakeVLLM, fake_d: FakeVLLM,
                                                         client: aiohttp.ClientSession,
                                                         loop: str) -> None:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "nixl_proxy.py"), "--port", str(port),
        "--prefiller-host", "127.0.0.1", "--prefiller-port", str(fake_p.port),
        "--decoder-host", "127.0.0.1", "--decoder-port", str(fake_d.port),
        "--event-loop", loop, stderr=asyncio.subprocess.PIPE)
    try:
        async def up() -> bool:
            try:
                async with client.get(f"http://127.0.0.1:{port}/health") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False
        await wait_for(up, timeout=20, what="the proxy process")
        async with client.post(f"http://127.0.0.1:{port}/v1/completions",
                               json={"model": "fake-model", "prompt": "x"}) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.stderr is not None
    log = (await proc.stderr.read()).decode()
    assert "NIXL proxy on 127.0.0.1" in log


@pytest.mark.parametrize(("flags", "message"), [
    (["--port", "{busy}", "--prefiller-host", "a", "--prefiller-port", "1",
      "--decoder-host", "b", "--decoder-port", "2"], "cannot serve on 127.0.0.1"),
    (["--port", "1", "--discovery-host", "127.0.0.1", "--discovery-port", "{busy}"],
     "cannot listen for discovery: Address already in use"),
], ids=["http", "discovery"])
async def test_port_in_use_is_a_clear_error(flags: list[str], message: str) -> None:
    sock = bound_socket()
    sock.listen()
    busy = str(sock.getsockname()[1])
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "nixl_proxy.py"),
            *[f.replace("{busy}", busy) for f in flags], stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        sock.close()
    assert proc.returncode == 1
    assert message in err.decode()
    assert "Traceback" not in err.decode()
