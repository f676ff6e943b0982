"""Fixtures: fake vLLM instances on port 0 and proxies served by hypercorn on a free port."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import zmq.asyncio
from aiohttp import web
from quart import Quart

import relay
from fake_vllm import FakeVLLM

POLL_INTERVAL_S = 0.02


async def wait_for(cond: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0,  # noqa: ASYNC109
                   what: str = "condition") -> None:
    """Poll ``cond`` until it is true, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = cond()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_INTERVAL_S)


def bound_socket() -> socket.socket:
    """A TCP socket bound to a free loopback port (handed to hypercorn as is)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class RunningProxy:
    """A proxy served on loopback."""

    app: Quart
    url: str  # http://127.0.0.1:PORT

    @property
    def state(self) -> relay.ProxyState:
        return relay.state_of(self.app)


@asynccontextmanager
async def serve_proxy(app: Quart, settings: relay.Settings) -> AsyncIterator[RunningProxy]:
    """Serve ``app`` with hypercorn on a free port until the block ends."""
    sock = bound_socket()
    port = sock.getsockname()[1]
    stop = asyncio.Event()
    task = asyncio.create_task(relay.serve(app, settings, shutdown=stop, sock=sock))
    running = RunningProxy(app, f"http://127.0.0.1:{port}")
    try:
        async with aiohttp.ClientSession() as s:
            async def up() -> bool:
                if task.done():
                    task.result()
                try:
                    async with s.get(f"{running.url}/healthcheck") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False
            await wait_for(up, what="proxy to serve")
        yield running
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def post(client: aiohttp.ClientSession, base_url: str, body: Any,
               route: str = "completions", **kw: Any) -> tuple[int, Any, Any]:
    """POST a body (JSON-encoded unless bytes/str) to ``base_url/v1/route``.

    Returns the status, the JSON answer (or the text when it is not JSON) and the headers.
    """
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    async with client.post(f"{base_url}/v1/{route}", data=data, headers=headers, **kw) as r:
        raw = await r.read()
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw.decode()
        return r.status, parsed, r.headers


@asynccontextmanager
async def serve_aiohttp(app: web.Application) -> AsyncIterator[int]:
    """Serve an aiohttp app on a free loopback port; yields the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@pytest.fixture
async def fake_p() -> AsyncIterator[FakeVLLM]:
    fake = FakeVLLM(name="P")
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def fake_d() -> AsyncIterator[FakeVLLM]:
    fake = FakeVLLM(name="D")
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
def zctx() -> Any:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()
