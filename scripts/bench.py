"""Throughput and latency of P/D proxies side by side, in front of the same fake vLLM instances.

    .venv/bin/python scripts/bench.py                       # nixl_proxy.py alone
    .venv/bin/python scripts/bench.py --router .venv-bench/bin/vllm-router   # and vLLM's router

One fake prefill and one fake decode instance (``scripts/fake_vllm.py``, no latency of their
own) run as separate processes; each proxy under test is started against them, warmed up, then
driven by a closed loop of ``--concurrency`` clients for ``--requests`` requests, non-streamed and
streamed. Proxies are measured in alternating rounds (A B A B ...) so that machine noise hits
both alike; the table reports the median round. What is measured is the proxy's own overhead:
two upstream calls, body rewriting and relaying, per request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0


@dataclass
class Round:
    """One measured batch of requests against one proxy."""

    target: str
    stream: bool
    seconds: float
    latencies_s: list[float]
    errors: int
    upstream_calls: dict[str, int]  # calls the fakes saw, by kind, during this round

    @property
    def rps(self) -> float:
        return len(self.latencies_s) / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def process(*cmd: str, log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """A child process, logging to ``log``, stopped (group and all) when the block ends."""
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=out, stderr=out,
                                                    start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: asyncio.subprocess.Process,
                     log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise SystemExit(f"{url} exited early; see {log}")
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise SystemExit(f"{url} not ready after {READY_TIMEOUT_S} s; see {log}")


async def drive(session: aiohttp.ClientSession, base: str, stream: bool, requests: int,
                concurrency: int) -> tuple[float, list[float], int]:
    """Closed loop: ``concurrency`` clients send ``requests`` requests in all."""
    body = {"model": "fake-model", "prompt": "The quick brown fox jumps over the lazy dog",
            "max_tokens": 16, "stream": stream}
    latencies: list[float] = []
    errors = 0
    left = requests

    async def client() -> None:
        nonlocal left, errors
        while left > 0:
            left -= 1
            started = time.perf_counter()
            try:
                async with session.post(f"{base}/v1/completions", json=body) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies, errors


async def fake_counts(session: aiohttp.ClientSession, ports: dict[str, int]) -> dict[str, int]:
    """Requests the fakes received so far, by kind (prefill legs, decode legs, plain)."""
    total: dict[str, int] = {}
    for port in ports.values():
        async with session.get(f"http://127.0.0.1:{port}/fake/stats") as r:
            for kind, n in (await r.json()).items():
                total[kind] = total.get(kind, 0) + n
    return total


def proxy_commands(p_port: int, d_port: int,
                   router: str | None) -> dict[str, tuple[int, list[str]]]:
    """Each proxy under test: its port and command line."""
    cmds = {}
    for loop in ("uvloop", "asyncio"):
        port = free_port()
        cmds[f"nixl_proxy.py ({loop})"] = (port, [
            sys.executable, str(ROOT / "nixl_proxy.py"), "--port", str(port),
            "--prefiller-host", "127.0.0.1", "--prefiller-port", str(p_port),
            "--decoder-host", "127.0.0.1", "--decoder-port", str(d_port),
            "--log-level", "WARNING", "--event-loop", loop])
    if router:
        rport = free_port()
        cmds["vllm-router"] = (rport, [
            router, "--host", "127.0.0.1", "--port", str(rport), "--vllm-pd-disaggregation",
            "--kv-connector", "nixl", "--prefill", f"http://127.0.0.1:{p_port}",
            "--decode", f"http://127.0.0.1:{d_port}", "--log-level", "warning"])
    return cmds


async def run(ns: argparse.Namespace) -> list[Round]:
    logs = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    ports = {"P": free_port(), "D": free_port()}
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=ns.concurrency)
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession(
            timeout=timeout, connector=connector))
        for role, port in ports.items():
            log = logs / f"fake-{role}.log"
            proc = await stack.enter_async_context(process(
                sys.executable, str(ROOT / "scripts" / "fake_vllm.py"), "--port", str(port),
                log=log))
            await wait_ready(session, f"http://127.0.0.1:{port}/health", proc, log)
        bases: dict[str, str] = {}
        for name, (port, cmd) in proxy_commands(ports["P"], ports["D"], ns.router).items():
            log = logs / f"{name}.log"
            proc = await stack.enter_async_context(process(*cmd, log=log))
            bases[name] = f"http://127.0.0.1:{port}"
            await wait_ready(session, f"{bases[name]}/health", proc, log)
            await drive(session, bases[name], False, ns.warmup, ns.concurrency)
        rounds = []
        for _ in range(ns.rounds):
            for stream in (False, True):
                for name, base in bases.items():
                    before = await fake_counts(session, ports)
                    seconds, lat, errors = await drive(session, base, stream, ns.requests,
                                                       ns.concurrency)
                    after = await fake_counts(session, ports)
                    calls = {k: after[k] - before[k] for k in after}
                    rounds.append(Round(name, stream, seconds, lat, errors, calls))
        print(f"logs in {logs}", file=sys.stderr)
        return rounds


def per_request(r: Round) -> str:
    n = max(1, len(r.latencies_s) + r.errors)
    return ", ".join(f"{kind} {count / n:.2f}" for kind, count in r.upstream_calls.items()
                     if count)


def report(rounds: list[Round], ns: argparse.Namespace) -> str:
    lines = [f"{ns.requests} requests x {ns.rounds} rounds, concurrency {ns.concurrency}, "
             f"max_tokens 16, fake P and D without latency; median round shown",
             "", "| proxy | mode | req/s | p50 ms | p99 ms | errors | upstream calls per request |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for name in dict.fromkeys(r.target for r in rounds):
        for stream in (False, True):
            mine = sorted((r for r in rounds if r.target == name and r.stream == stream),
                          key=lambda r: r.rps)
            mid = mine[len(mine) // 2]
            lines.append(f"| {name} | {'stream' if stream else 'json'} | {mid.rps:.0f} | "
                         f"{mid.pct(0.5):.1f} | {mid.pct(0.99):.1f} | "
                         f"{sum(r.errors for r in mine)} | {per_request(mid)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--router", help="path to a vllm-router binary to compare with")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=200)
    ns = p.parse_args(argv)
    print(report(asyncio.run(run(ns)), ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
