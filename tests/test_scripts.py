"""scripts/: the announce sidecar and the demo, as a user runs them."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest
import zmq.asyncio

import announce
import registry
from conftest import bound_socket, wait_for
from fake_vllm import FakeVLLM

ROOT = Path(__file__).resolve().parent.parent


async def test_announce_follows_instance_health(zctx: zmq.asyncio.Context) -> None:
    table = registry.InstanceTable(ttl_s=0.6)
    listener = registry.DiscoveryListener(table, "127.0.0.1", 0, zctx)
    listen_task = asyncio.create_task(listener.run())
    fake = FakeVLLM()
    await fake.start()
    ns = announce.build_parser().parse_args([
        "--role", "D", "--http-address", f"127.0.0.1:{fake.port}", "--proxy",
        listener.endpoint.removeprefix("tcp://"), "--interval", "0.1"])
    stop = asyncio.Event()
    task = asyncio.create_task(announce.run(announce.announcement_from(ns), ns.proxy,
                                            ns.interval, stop))
    try:
        await wait_for(lambda: table.count("D") == 1, what="announcement")
        assert table.routable("D")[0].base_url == fake.base_url
        await fake.stop()
        await wait_for(lambda: table.count("D") == 0, timeout=5,
                       what="the unhealthy instance to expire")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        listen_task.cancel()
        await asyncio.gather(listen_task, return_exceptions=True)


def test_announce_rejects_a_bad_address(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        announce.main(["--role", "P", "--http-address", "nowhere", "--proxy", "x:1"])
    assert "not host:port" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["nixl", "moriio", "moriio-write"])
async def test_demo_serves_and_stops_cleanly(mode: str, client: aiohttp.ClientSession) -> None:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    proc = await asyncio.create_subprocess_exec(
        "bash", str(ROOT / "scripts" / "demo.sh"), mode, env={**os.environ, "PORT": str(port)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert proc.stdout is not None
    out = b""
    try:
        while b"Press Ctrl-C to stop." not in out:
            line = await asyncio.wait_for(proc.stdout.readline(), 90)
            assert line, f"demo ended early:\n{out.decode()}"
            out += line
        body = {"model": "fake-model", "prompt": "Hello", "max_tokens": 4, "stream": True}
        async with client.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            assert r.status == 200
            assert (await r.text()).endswith("data: [DONE]\n\n")
        proc.send_signal(signal.SIGINT)
        rest = await asyncio.wait_for(proc.stdout.read(), 30)
        await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert b"demo stopped" in rest
    assert b"Traceback" not in out + rest
    assert f"curl -s http://127.0.0.1:{port}/v1/completions".encode() in out
    # Every child is gone: nothing answers on the proxy's port any more.
    with pytest.raises(aiohttp.ClientConnectionError):
        async with client.get(f"http://127.0.0.1:{port}/health"):
            pass
