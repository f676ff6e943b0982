"""moriio_proxy.py end to end: announced fake MoRIIO instances, real DEALER sockets."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

import moriio_proxy
import registry
import relay
from conftest import RunningProxy, post, serve_proxy, wait_for
from fake_vllm import FakeVLLM, announcement_for
from registry import Instance

MODEL = "fake-model"
RID = re.compile(r"___prefill_addr_(.+)___decode_addr_(.+)_([0-9a-f]{32})")


def moriio_settings(*extra: str) -> relay.Settings:
    s = moriio_proxy.parse_args(["--host", "127.0.0.1", "--discovery-host", "127.0.0.1",
                                 *extra])
    return relay.Settings(**{**s.__dict__, "discovery_port": 0})


@pytest.fixture
async def proxy() -> AsyncIterator[RunningProxy]:
    s = moriio_settings("--read-timeout", "5")
    async with serve_proxy(moriio_proxy.create_app(s), s) as px:
        yield px


async def make_fake(name: str, mode: str | None = "READ", dp: int = 1, tp: int = 1,
                    **kw: Any) -> FakeVLLM:
    fake = FakeVLLM(name=name, connector="moriio", transfer_mode=mode, dp_size=dp, tp_size=tp,
                    **kw)
    await fake.start()
    return fake


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeVLLM]]:
    made: list[FakeVLLM] = []
    yield made
    for f in made:
        await f.stop()


async def announce(px: RunningProxy, zctx: zmq.asyncio.Context, fake: FakeVLLM, role: str,
                   dialect: str = "moriio") -> None:
    endpoint = px.state.listener.endpoint  # type: ignore[union-attr]
    a = registry.Announcer(announcement_for(fake, role, dialect), endpoint, ctx=zctx)
    await a.send_once()
    a.close()
    await wait_for(lambda: any(e["url"] == fake.base_url for e in px.state.table.snapshot()),
                   what=f"{fake.name} registered")


async def deploy(px: RunningProxy, zctx: zmq.asyncio.Context, fakes: list[FakeVLLM],
                 mode: str = "READ", p_kw: dict[str, Any] | None = None,
                 d_kw: dict[str, Any] | None = None) -> tuple[FakeVLLM, FakeVLLM]:
    p = await make_fake("P", mode, **(p_kw or {}))
    d = await make_fake("D", mode, **(d_kw or {}))
    fakes += [p, d]
    await announce(px, zctx, p, "P")
    await announce(px, zctx, d, "D")
    return p, d


def inst(port: int, role: str, dp: int = 1, tp: int = 1) -> Instance:
    return Instance(role, f"http://10.0.0.{port % 250}:{port}/v1",
                    f"host:10.0.0.{port % 250},handshake:{port + 1},notify:{port + 2}", dp, tp)


# --------------------------------------------------------------------------- builders


def test_request_id_format() -> None:
    p, d = inst(8100, "P"), inst(8200, "D")
    rid = moriio_proxy.make_request_id(p, d)
    m = RID.fullmatch(rid)
    assert m is not None
    assert m.group(1) == p.zmq_address and m.group(2) == d.zmq_address
    assert rid.startswith("___prefill_addr_host:10.0.0.100,handshake:8101,notify:8102"
                          "___decode_addr_host:10.0.0.200,handshake:8201,notify:8202_")


def test_bodies_for_a_dp_prefill() -> None:
    plan = moriio_proxy.Plan(prefill=inst(8100, "P", dp=4, tp=2), prefill_rank=3,
                             decode=inst(8200, "D", dp=1, tp=8), decode_rank=None,
                             request_id="rid", transfer_id="tx-1")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 9, "min_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    assert moriio_proxy.build_prefill_body(body, plan) == {
        "model": MODEL, "prompt": "x", "max_tokens": 1, "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_dp_size": 1, "remote_tp_size": 8,
            "transfer_id": "tx-1", "remote_host": "10.0.0.200",
            "remote_handshake_port": 8201, "remote_notify_port": 8202}}
    answer = {"remote_engine_id": "eng", "remote_block_ids": [4, 5], "transfer_id": "tx-1",
              "tp_size": 2, "unrelated": True}
    assert moriio_proxy.build_decode_body(body, plan, answer) == {
        **body, "kv_transfer_params": {
            "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "eng",
            "remote_block_ids": [4, 5], "transfer_id": "tx-1", "remote_host": "10.0.0.100",
            "remote_handshake_port": 8101, "remote_notify_port": 8102, "remote_dp_size": 4,
            "remote_tp_size": 2, "tp_size": 2, "remote_dp_rank": 3}}
    assert body["max_tokens"] == 9, "the client's body is never mutated"


def test_cli_defaults_match_the_reference() -> None:
    s = moriio_proxy.parse_args([])
    assert (s.host, s.port, s.discovery_host, s.discovery_port) == (
        "0.0.0.0", 10001, "0.0.0.0", 36367)


# --------------------------------------------------------------------------- flows


async def test_read_mode_prefill_then_decode(proxy: RunningProxy, zctx: zmq.asyncio.Context,
                                             fakes: list[FakeVLLM],
                                             client: aiohttp.ClientSession) -> None:
    p, d = await deploy(proxy, zctx, fakes, "READ", p_kw={"prefill_latency_s": 0.3, "tp": 2})
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": "a b c",
                                                "max_tokens": 5})
    assert status == 200, answer
    assert d.received[0].at >= p.completed_at[0], "READ: D only after P answered"
    rid = p.received[0].headers["X-Request-Id"]
    assert d.received[0].headers["X-Request-Id"] == rid
    m = RID.fullmatch(rid)
    assert m is not None and m.groups()[:2] == (p.zmq_address, d.zmq_address)
    p_ktp = p.bodies()[0]["kv_transfer_params"]
    d_ktp = d.bodies()[0]["kv_transfer_params"]
    assert p_ktp["transfer_id"] == d_ktp["transfer_id"]
    assert d_ktp["remote_engine_id"] == p.engine_id
    assert d_ktp["remote_block_ids"] == p.returned_ktp[0]["remote_block_ids"]
    assert d_ktp["tp_size"] == d_ktp["remote_tp_size"] == 2
    assert "X-data-parallel-rank" not in p.received[0].headers
    assert answer["usage"]["completion_tokens"] == 5


async def test_write_mode_sends_both_at_once(proxy: RunningProxy, zctx: zmq.asyncio.Context,
                                             fakes: list[FakeVLLM],
                                             client: aiohttp.ClientSession) -> None:
    p, d = await deploy(proxy, zctx, fakes, "WRITE", p_kw={"prefill_latency_s": 0.5})
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": "a b c",
                                                "max_tokens": 4, "stream": True})
    assert status == 200
    assert d.received[0].at < p.completed_at[0], "WRITE: D starts before P answered"
    assert d.bodies()[0]["kv_transfer_params"]["remote_engine_id"] is None
    assert answer.rstrip().endswith("data: [DONE]")
    async with client.get(f"{proxy.url}/metrics") as r:
        assert "after_decode_output" not in await r.text()


@pytest.mark.parametrize("stream", [False, True])
async def test_write_mode_prefill_failure_reaches_client(
        proxy: RunningProxy, zctx: zmq.asyncio.Context, fakes: list[FakeVLLM],
        client: aiohttp.ClientSession, stream: bool) -> None:
    # D waits for KV that never comes; P fails first.
    p, d = await deploy(proxy, zctx, fakes, "WRITE", d_kw={"prefill_latency_s": 3})
    p.faults.status = 503
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": "x",
                                                "max_tokens": 4, "stream": stream})
    assert status == 503
    assert answer["error"]["message"] == "injected fault 503"
    await wait_for(lambda: d.cancelled == 1, what="D to be cancelled")


async def test_write_mode_late_prefill_failure_is_logged_and_counted(
        proxy: RunningProxy, zctx: zmq.asyncio.Context, fakes: list[FakeVLLM],
        client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    p, _ = await deploy(proxy, zctx, fakes, "WRITE", p_kw={"prefill_latency_s": 0.4},
                        d_kw={"token_latency_s": 0.1})
    p.faults.status = 500
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": "x",
                                                "max_tokens": 8, "stream": True})
    assert status == 200 and answer.rstrip().endswith("data: [DONE]")
    async with client.get(f"{proxy.url}/metrics") as r:
        text = await r.text()
    assert ('pd_proxy_leg_failures_total{kind="after_decode_output",leg="prefill"} 1.0'
            in text)
    assert any("prefill failed after decode produced output" in r.getMessage()
               for r in caplog.records)


async def test_dp_slots_are_covered_evenly(proxy: RunningProxy, zctx: zmq.asyncio.Context,
                                           fakes: list[FakeVLLM],
                                           client: aiohttp.ClientSession) -> None:
    ps = [await make_fake(f"P{i}", dp=4) for i in range(2)]
    d = await make_fake("D")
    fakes += [*ps, d]
    for p in ps:
        await announce(proxy, zctx, p, "P")
    await announce(proxy, zctx, d, "D")
    n = 8 * 5 + 3
    for _ in range(n):
        assert (await post(client, proxy.url, {"model": MODEL, "prompt": "x",
                                           "max_tokens": 1}))[0] == 200
    slots = Counter((p.name, r.headers["X-data-parallel-rank"]) for p in ps for r in p.received)
    assert len(slots) == 8, "every (instance, rank) slot gets traffic"
    assert max(slots.values()) - min(slots.values()) <= 1
    for r, body in zip(d.received, d.bodies(), strict=True):
        assert "X-data-parallel-rank" not in r.headers, "D has no DP: not pinned"
        assert body["kv_transfer_params"]["remote_dp_size"] == 4
    p_ranks = [int(r.headers["X-data-parallel-rank"]) for p in ps for r in p.received]
    assert sorted(p_ranks) == sorted(b["kv_transfer_params"]["remote_dp_rank"]
                                     for b in d.bodies())


@pytest.mark.parametrize(("d_dp", "pinned"), [(2, True), (3, False)])
async def test_decode_rank(proxy: RunningProxy, zctx: zmq.asyncio.Context,
                           fakes: list[FakeVLLM], client: aiohttp.ClientSession,
                           d_dp: int, pinned: bool) -> None:
    p, d = await deploy(proxy, zctx, fakes, p_kw={"dp": 2}, d_kw={"dp": d_dp})
    for _ in range(6):
        assert (await post(client, proxy.url, {"model": MODEL, "prompt": "x",
                                           "max_tokens": 1}))[0] == 200
    p_ranks = [r.headers["X-data-parallel-rank"] for r in p.received]
    d_ranks = [r.headers["X-data-parallel-rank"] for r in d.received]
    if pinned:
        assert d_ranks == p_ranks
    else:
        assert d_ranks == ["0", "1", "2", "0", "1", "2"]


async def test_transfer_mode_mismatch_is_refused_not_fatal(
        proxy: RunningProxy, zctx: zmq.asyncio.Context, fakes: list[FakeVLLM],
        client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    p = await make_fake("P", "READ")
    wrong = await make_fake("Dw", "WRITE")
    right = await make_fake("Dr", "READ")
    fakes += [p, wrong, right]
    await announce(proxy, zctx, p, "P")
    await announce(proxy, zctx, wrong, "D")
    async with client.get(f"{proxy.url}/instances") as r:
        listing = await r.json()
    assert listing["transfer_mode"] == "READ"
    refused = next(i for i in listing["instances"] if i["url"] == wrong.base_url)
    assert refused["state"] == "refused" and "WRITE" in refused["refused_reason"]
    assert any(rec.levelname == "ERROR" and "refusing instance" in rec.getMessage()
               for rec in caplog.records)
    assert (await post(client, proxy.url, {"model": MODEL, "prompt": "x"}))[0] == 503
    await announce(proxy, zctx, right, "D")
    assert (await post(client, proxy.url, {"model": MODEL, "prompt": "x"}))[0] == 200
    assert wrong.received == []


async def test_old_dialect_completions_address_still_routes_chat(
        proxy: RunningProxy, zctx: zmq.asyncio.Context, fakes: list[FakeVLLM],
        client: aiohttp.ClientSession) -> None:
    p = await make_fake("P")
    d = await make_fake("D")
    fakes += [p, d]
    for fake, role in ((p, "P"), (d, "D")):
        endpoint = proxy.state.listener.endpoint  # type: ignore[union-attr]
        sock = zctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        await sock.send(json_to_msgpack({
            "type": "register", "role": role, "index": "3",
            "request_address": f"{fake.base_url}/completions",
            "handshake_port": int(fake.zmq_address.split("handshake:")[1].split(",")[0]),
            "notify_port": int(fake.zmq_address.split("notify:")[1]),
            "dp_size": 1, "tp_size": 1, "transfer_mode": "READ"}))
        sock.close(linger=1000)
    await wait_for(lambda: proxy.state.table.count("D") == 1 and
                   proxy.state.table.count("P") == 1, what="old-dialect registration")
    status, answer, _ = await post(client, proxy.url, {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        "chat/completions")
    assert status == 200, answer
    assert p.received[0].path == d.received[0].path == "/v1/chat/completions"
    assert answer["object"] == "chat.completion"


def json_to_msgpack(obj: dict[str, Any]) -> bytes:
    import msgpack
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


@pytest.mark.parametrize(("route", "body"), [
    ("completions", {"prompt": "one two", "max_tokens": 7}),
    ("chat/completions", {"messages": [{"role": "user", "content": "q"}], "max_tokens": 7}),
    ("chat/completions", {"messages": [{"role": "user", "content": "q"}],
                          "max_completion_tokens": 7}),
])
@pytest.mark.parametrize("mode", ["READ", "WRITE"])
@pytest.mark.parametrize("stream", [False, True])
async def test_client_gets_exactly_the_tokens_it_asked_for(
        proxy: RunningProxy, zctx: zmq.asyncio.Context, fakes: list[FakeVLLM],
        client: aiohttp.ClientSession, route: str, body: dict[str, Any], mode: str,
        stream: bool) -> None:
    _, d = await deploy(proxy, zctx, fakes, mode)
    full = {"model": MODEL, **body, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    status, answer, _ = await post(client, proxy.url, full, route)
    assert status == 200, answer
    if stream:
        events = [json.loads(line[6:]) for line in answer.split("\n")
                  if line.startswith("data: {")]
        usage = events[-1]["usage"]
        pieces = [c.get("text") or c.get("delta", {}).get("content")
                  for e in events for c in e["choices"]]
        assert len([x for x in pieces if x]) == 7
    else:
        usage = answer["usage"]
    assert usage["completion_tokens"] == 7
    d_body = d.bodies()[0]
    assert {k: v for k, v in d_body.items() if k != "kv_transfer_params"} == full


async def test_no_max_tokens_and_min_tokens(proxy: RunningProxy, zctx: zmq.asyncio.Context,
                                            fakes: list[FakeVLLM],
                                            client: aiohttp.ClientSession) -> None:
    p, d = await deploy(proxy, zctx, fakes)
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": "x"})
    assert status == 200 and answer["usage"]["completion_tokens"] == 16
    assert "max_tokens" not in d.bodies()[0]
    status, _, _ = await post(client, proxy.url, {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}], "max_tokens": 6, "min_tokens": 5},
        "chat/completions")
    assert status == 200
    assert "min_tokens" not in p.bodies()[1] and p.bodies()[1]["max_tokens"] == 1
    assert d.bodies()[1]["min_tokens"] == 5 and d.bodies()[1]["max_tokens"] == 6
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}], "max_tokens": 50, "max_completion_tokens": 3,
        "min_tokens": 5}, "chat/completions")
    assert status == 400
    assert answer["error"]["message"] == ("min_tokens must be less than or equal to "
                                          "max_tokens=3, got 5.")
    assert len(p.received) == 2, "refused before P prefilled anything"


async def test_silent_instance_expires(zctx: zmq.asyncio.Context, fakes: list[FakeVLLM],
                                       client: aiohttp.ClientSession) -> None:
    s = moriio_settings("--instance-ttl", "0.4")
    async with serve_proxy(moriio_proxy.create_app(s), s) as px:
        await deploy(px, zctx, fakes)
        assert (await post(client, px.url, {"model": MODEL, "prompt": "x"}))[0] == 200
        await wait_for(lambda: px.state.table.snapshot() == [], timeout=5, what="expiry")
        status, answer, _ = await post(client, px.url, {"model": MODEL, "prompt": "x"})
        assert status == 503 and "no prefill instance" in answer["error"]["message"]


async def test_decode_rejects_a_broken_request_id(proxy: RunningProxy,
                                                  zctx: zmq.asyncio.Context,
                                                  fakes: list[FakeVLLM]) -> None:
    """The fake's checks are real: a request id naming other peers is a 400."""
    _, d = await deploy(proxy, zctx, fakes)
    async with aiohttp.ClientSession() as s, s.post(
            f"{d.base_url}/completions",
            json={"model": MODEL, "prompt": "x", "kv_transfer_params": {
                "do_remote_prefill": True, "transfer_id": "tx-1"}},
            headers={"X-Request-Id": "plain-uuid"}) as r:
        assert r.status == 400
        assert "request id" in (await r.json())["error"]["message"]


@pytest.mark.parametrize("mode", ["READ", "WRITE"])
async def test_several_prompts_get_a_flow_each(proxy: RunningProxy, zctx: zmq.asyncio.Context,
                                               fakes: list[FakeVLLM],
                                               client: aiohttp.ClientSession, mode: str) -> None:
    p, d = await deploy(proxy, zctx, fakes, mode)
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": ["a b", "c"],
                                                       "max_tokens": 2})
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 4
    transfer_ids = {b["kv_transfer_params"]["transfer_id"] for b in d.bodies()}
    assert len(transfer_ids) == 2 and len(p.received) == 2
