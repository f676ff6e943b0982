"""nixl_proxy.py in front of real vLLM (CPU build): prefill and decode with NIXL moving real KV.

Run by ``scripts/test_real_vllm.sh``, which installs vLLM into its own venv and builds a tiny
model, then sets REAL_VLLM_PYTHON and REAL_VLLM_MODEL. The servers are started once for the
module. The last test kills the prefill server, so it stays last.

What "correct" means here (shared/spec/REAL_VLLM_CPU.md): at temperature 0 with a model whose
output depends on the prompt, the answer through P->D equals one server's direct answer, and D's
metrics show the prompt arrived by KV transfer instead of being computed on D.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

import nixl_proxy
import relay
from conftest import RunningProxy, bound_socket, post, serve_aiohttp, serve_proxy, wait_for

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
MAX_MODEL_LEN = 512
READY_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 120

SHORT_PROMPT = "Red Hat is "
PROMPT = ("Red Hat is the best company in the world to work for because it works on open source "
          "software, which means that all the contributions are delivered to the community. As "
          "a result,")
LONG_PROMPT = PROMPT + (" when working on projects like vLLM we are able to meet many amazing "
                        "people from various organizations like AMD, Google, NVIDIA, ")
BLOCKS_PROMPT = " ".join(f"def function_{i}(value): return value * {i} + {i * i}"
                         for i in range(25))


# --------------------------------------------------------------------------- servers


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Servers:
    p: Server
    d: Server


def _free_port() -> int:
    sock = bound_socket()
    port: int = sock.getsockname()[1]
    sock.close()
    return port


def _start(role: str, core: int, model: Path, python: str, log_dir: Path) -> Server:
    port, side = _free_port(), _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_HOST_IP": "127.0.0.1", "UCX_NET_DEVICES": "lo",
           "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
    ktc = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    log = log_dir / f"vllm-{role}.log"
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--max-num-seqs", "8",
           "--enable-log-requests",
           "--chat-template", str(model / "chat_template.jinja"),
           "--kv-transfer-config", json.dumps(ktc)]
    with log.open("wb") as out:
        # A session of its own: vLLM forks an engine and a worker, and killing the server
        # must take them along (the worker alone keeps serving KV to D).
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Server(f"http://127.0.0.1:{port}", proc, log)


def _healthy(server: Server) -> bool:
    try:
        with urllib.request.urlopen(f"{server.url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _wait_ready(servers: list[Server]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all(_healthy(s) for s in servers):
        for s in servers:
            if s.proc.poll() is not None:
                pytest.fail(f"vLLM exited with {s.proc.returncode} before it was ready:\n"
                            f"{s.tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"vLLM not ready after {READY_TIMEOUT_S} s:\n" +
                        "\n".join(s.tail(15) for s in servers))
        time.sleep(1)


def _kill_group(server: Server, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, sig)


def _stop(server: Server) -> None:
    _kill_group(server, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(30)
    _kill_group(server, signal.SIGKILL)  # whatever of the group is left
    server.proc.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    python, model = os.environ.get("REAL_VLLM_PYTHON"), os.environ.get("REAL_VLLM_MODEL")
    if not python or not model:
        pytest.fail("REAL_VLLM_PYTHON and REAL_VLLM_MODEL are not set: run "
                    "scripts/test_real_vllm.sh, which installs vLLM and builds the model")
    log_dir = Path(os.environ.get("REAL_VLLM_LOG_DIR") or tmp_path_factory.mktemp("vllm"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    p = _start("kv_producer", 0, Path(model), python, log_dir)
    d = _start("kv_consumer", 1, Path(model), python, log_dir)
    try:
        _wait_ready([p, d])
        print(f"\nvLLM P and D ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
        yield Servers(p, d)
    finally:
        _stop(p)
        _stop(d)


@pytest.fixture
async def proxy(servers: Servers) -> AsyncIterator[RunningProxy]:
    s = nixl_proxy.parse_args([
        "--prefiller-host", "127.0.0.1", "--prefiller-port", str(servers.p.port),
        "--decoder-host", "127.0.0.1", "--decoder-port", str(servers.d.port),
        "--read-timeout", str(REQUEST_TIMEOUT_S)])
    async with serve_proxy(nixl_proxy.create_app(s), s) as px:
        yield px


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        yield s


# --------------------------------------------------------------------------- helpers


async def answer(client: aiohttp.ClientSession, base: str, body: dict[str, Any],
                 route: str = "completions") -> dict[str, Any]:
    status, data, _ = await post(client, base, body, route)
    assert status == 200, data
    assert isinstance(data, dict)
    return data


def streamed_text(sse: str) -> tuple[str, list[dict[str, Any]]]:
    events = [json.loads(line[6:]) for line in sse.split("\n") if line.startswith("data: {")]
    assert sse.rstrip().endswith("data: [DONE]"), sse[-300:]
    text = "".join((c.get("text") or (c.get("delta") or {}).get("content") or "")
                   for e in events for c in e.get("choices", []))
    return text, events


def choice_text(data: dict[str, Any]) -> str:
    choice = data["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


async def d_metrics(client: aiohttp.ClientSession, servers: Servers) -> dict[str, float]:
    """D's counters of interest: prompt tokens by source, NIXL transfers and failures."""
    async with client.get(f"{servers.d.url}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                out[sample.labels["source"]] = sample.value
            elif sample.name in ("vllm:nixl_xfer_time_seconds_count",
                                 "vllm:nixl_num_failed_transfers_total"):
                out[sample.name] = sample.value
    return out


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def completion(prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 16,
            "ignore_eos": True, **kw}


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, BLOCKS_PROMPT], ids=["short", "blocks"])
async def test_output_equals_one_server_and_kv_was_transferred(
        proxy: RunningProxy, servers: Servers, client: aiohttp.ClientSession,
        prompt: str) -> None:
    body = completion(prompt, logprobs=1)
    before = await d_metrics(client, servers)
    via = await answer(client, proxy.url, body)
    after = await d_metrics(client, servers)
    direct = await answer(client, servers.p.url, body)
    assert choice_text(via) == choice_text(direct)
    assert via["usage"]["completion_tokens"] == 16
    got = via["choices"][0]["logprobs"]["token_logprobs"]
    want = direct["choices"][0]["logprobs"]["token_logprobs"]
    assert got == pytest.approx(want, abs=1e-3)
    prompt_tokens = via["usage"]["prompt_tokens"]
    if prompt == BLOCKS_PROMPT:
        assert prompt_tokens > 4 * 16, "several KV blocks"
    assert delta(after, before, "external_kv_transfer") == prompt_tokens
    assert delta(after, before, "local_compute") == 0, "D must not recompute the prompt"
    assert delta(after, before, "vllm:nixl_xfer_time_seconds_count") >= 1
    assert delta(after, before, "vllm:nixl_num_failed_transfers_total") == 0


async def test_full_prefix_cache_hit_on_decode(proxy: RunningProxy, servers: Servers,
                                               client: aiohttp.ClientSession) -> None:
    body = completion(PROMPT)
    primed = await answer(client, servers.d.url, body)  # D caches PROMPT; P has not seen it
    before = await d_metrics(client, servers)
    via = await answer(client, proxy.url, body)
    after = await d_metrics(client, servers)
    assert choice_text(via) == choice_text(primed)
    # Whether D takes cached blocks or pulls them again, it never recomputes the prompt.
    assert delta(after, before, "local_compute") == 0, (before, after)
    assert delta(after, before, "vllm:nixl_num_failed_transfers_total") == 0
    # Then a partial hit: PROMPT's blocks are cached on D, LONG_PROMPT's tail is not.
    via_long = await answer(client, proxy.url, completion(LONG_PROMPT))
    direct_long = await answer(client, servers.p.url, completion(LONG_PROMPT))
    assert choice_text(via_long) == choice_text(direct_long)


async def test_chat_and_streaming_equal_direct(proxy: RunningProxy, servers: Servers,
                                               client: aiohttp.ClientSession) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about " + PROMPT}],
            "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    direct_chat = choice_text(await answer(client, servers.p.url, chat, "chat/completions"))
    assert choice_text(await answer(client, proxy.url, chat, "chat/completions")) == direct_chat
    status, sse, _ = await post(client, proxy.url, {**chat, "stream": True}, "chat/completions")
    assert status == 200
    assert streamed_text(sse)[0] == direct_chat
    body = completion("class Foo: pass")
    direct = choice_text(await answer(client, servers.p.url, body))
    status, sse, _ = await post(client, proxy.url, {**body, "stream": True})
    assert status == 200
    assert streamed_text(sse)[0] == direct


async def test_several_prompts_each_get_their_own_kv(proxy: RunningProxy, servers: Servers,
                                                     client: aiohttp.ClientSession) -> None:
    """One kv_transfer_params set for several prompts fails in vLLM; split, each matches."""
    prompts = ["def first(a):", "class Second(object):", BLOCKS_PROMPT[:200]]
    via = await answer(client, proxy.url, {**completion(prompts[0]), "prompt": prompts})
    assert [c["index"] for c in via["choices"]] == [0, 1, 2]
    for choice, prompt in zip(via["choices"], prompts, strict=True):
        assert choice["text"] == choice_text(await answer(client, servers.p.url,
                                                          completion(prompt)))
    status, sse, _ = await post(client, proxy.url, {**completion(prompts[0]), "prompt": prompts,
                                                    "stream": True})
    assert status == 200
    _, events = streamed_text(sse)
    texts = ["", "", ""]
    for event in events:
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in via["choices"]]


async def test_budget_min_tokens_and_stream_options_reach_decode(
        proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    # P accepts its leg (min_tokens removed; vLLM PR #39706) and D honours all of it.
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 10,
            "min_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
    status, sse, _ = await post(client, proxy.url, body)
    assert status == 200, sse
    _, events = streamed_text(sse)
    assert events[-1]["usage"]["completion_tokens"] == 10
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "max_completion_tokens": 7, "min_tokens": 7}
    data = await answer(client, proxy.url, chat, "chat/completions")
    assert data["usage"]["completion_tokens"] == 7


async def test_min_tokens_above_budget_is_refused_before_prefill(
        proxy: RunningProxy, servers: Servers, client: aiohttp.ClientSession) -> None:
    """Sent on, P would prefill and D would answer 400 yet pull the KV and stall the next
    requests until P's lease expired (vLLM 0.32, seen here): the proxy refuses it first."""
    body = completion(PROMPT, max_tokens=4, min_tokens=8)
    before = await d_metrics(client, servers)
    refusals = [await post(client, proxy.url, {**body, "stream": stream})
                for stream in (False, True)]
    after = await d_metrics(client, servers)
    for key in ("external_kv_transfer", "local_compute"):
        assert delta(after, before, key) == 0, "the refused requests never reached D"
    _, direct, _ = await post(client, servers.d.url, body)
    for status, via, _ in refusals:
        assert status == 400
        assert via["error"]["message"] == direct["error"]["message"]
    # And the next request is served.
    served = await answer(client, proxy.url, completion(SHORT_PROMPT + "after", max_tokens=4))
    assert served["usage"]["completion_tokens"] == 4


async def test_openai_sdk(proxy: RunningProxy, servers: Servers) -> None:
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k",
                                  max_retries=0) as sdk, openai.AsyncOpenAI(
            base_url=f"{servers.p.url}/v1", api_key="k", max_retries=0) as direct:
        kw: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 8,
                              "extra_body": {"ignore_eos": True}}
        want = (await direct.completions.create(prompt=SHORT_PROMPT, **kw)).choices[0].text
        got = (await sdk.completions.create(prompt=SHORT_PROMPT, **kw)).choices[0].text
        assert got == want
        streamed = ""
        async for part in await sdk.completions.create(prompt=SHORT_PROMPT, stream=True, **kw):
            streamed += part.choices[0].text if part.choices else ""
        assert streamed == want
        messages: Any = [{"role": "user", "content": "hello"}]
        want_chat = (await direct.chat.completions.create(messages=messages, **kw))
        got_chat = (await sdk.chat.completions.create(messages=messages, **kw))
        assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
        models = await sdk.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_announced_real_instances(servers: Servers,
                                        client: aiohttp.ClientSession) -> None:
    s = nixl_proxy.parse_args(["--discovery-host", "127.0.0.1", "--discovery-port", "1",
                               "--read-timeout", str(REQUEST_TIMEOUT_S)])
    s = relay.Settings(**{**s.__dict__, "discovery_port": 0})
    async with serve_proxy(nixl_proxy.create_app(s), s) as px:
        endpoint = px.state.listener.endpoint.removeprefix("tcp://")  # type: ignore[union-attr]
        procs = [await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "scripts" / "announce.py"), "--role", role,
            "--http-address", srv.url.removeprefix("http://"), "--proxy", endpoint,
            "--interval", "1") for role, srv in (("P", servers.p), ("D", servers.d))]
        try:
            await wait_for(lambda: px.state.table.count("P") == px.state.table.count("D") == 1,
                           timeout=30, what="announce.py to register both servers")
            body = completion(SHORT_PROMPT + "announced")
            via = await answer(client, px.url, body)
            direct = await answer(client, servers.p.url, body)
            assert choice_text(via) == choice_text(direct)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), 10)


async def test_decode_rejection_reaches_client(proxy: RunningProxy, servers: Servers,
                                               client: aiohttp.ClientSession) -> None:
    """A request only D can reject (P's copy is valid): D's 400 reaches the client as is.

    Near the end on purpose: P then holds KV that nobody pulls until its 30 s lease expires,
    and vLLM 0.32's P was seen answering other requests only after that (see the README).
    """
    # vLLM 0.32 caps a max_tokens beyond the model length instead of rejecting it (seen here);
    # stream_options without streaming is removed from P's copy, so only D refuses it.
    body = completion(PROMPT, stream_options={"include_usage": True})
    status, via, _ = await post(client, proxy.url, body)
    direct_status, direct, _ = await post(client, servers.d.url, body)
    assert (status, direct_status) == (400, 400), (via, direct)
    assert via == direct


# --------------------------------------------------------------------------- last: P dies


async def test_prefill_killed_after_prefill(servers: Servers,
                                            client: aiohttp.ClientSession) -> None:
    """P answers its prefill, then dies before D pulls the KV: the client gets a clear error
    and the proxy keeps serving. A pass-through in front of P does the killing."""

    async def prefill_then_kill(request: web.Request) -> web.Response:
        async with client.post(f"{servers.p.url}{request.path}", data=await request.read(),
                               headers={"Content-Type": "application/json"}) as r:
            body, status = await r.read(), r.status
        _kill_group(servers.p, signal.SIGKILL)
        await asyncio.to_thread(servers.p.proc.wait)
        return web.Response(body=body, status=status, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/{route:.*}", prefill_then_kill)
    async with contextlib.AsyncExitStack() as interposer:
        port = await interposer.enter_async_context(serve_aiohttp(app))
        s = nixl_proxy.parse_args([
            "--prefiller-host", "127.0.0.1", "--prefiller-port", str(port),
            "--decoder-host", "127.0.0.1", "--decoder-port", str(servers.d.port),
            "--read-timeout", str(REQUEST_TIMEOUT_S)])
        async with serve_proxy(nixl_proxy.create_app(s), s) as px:
            # A prompt D has no block of, so that D must pull all of it from the dead P.
            fresh = " ".join(f"kill{i}" for i in range(60))
            status, data, _ = await post(client, px.url, completion(fresh))
            assert status >= 500, data
            assert set(data["error"]) >= {"message", "type", "code"}
            assert servers.p.proc.returncode is not None
            # The proxy is still serving: health, models from D, and a clean error for the
            # next request, whose prefill instance is gone.
            async with client.get(f"{px.url}/healthcheck") as r:
                assert r.status == 200
            async with client.get(f"{px.url}/v1/models") as r:
                assert r.status == 200
            await interposer.aclose()
            status, data, _ = await post(client, px.url, completion(PROMPT))
            assert status == 502
            assert "cannot connect to the prefill instance" in data["error"]["message"]
    assert _healthy(servers.d), "D survives a failed transfer"
