"""nixl_proxy.py end to end: real hypercorn, real fake vLLM servers, real HTTP clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import zmq.asyncio
from aiohttp import web

import nixl_proxy
import registry
import relay
from conftest import RunningProxy, post, serve_aiohttp, serve_proxy, wait_for
from fake_vllm import FakeVLLM

MODEL = "fake-model"


def settings_for(p: FakeVLLM | list[FakeVLLM], d: FakeVLLM | list[FakeVLLM],
                 *extra: str) -> relay.Settings:
    ps, ds = (p if isinstance(p, list) else [p]), (d if isinstance(d, list) else [d])
    return nixl_proxy.parse_args([
        "--prefiller-hosts", *["127.0.0.1"] * len(ps),
        "--prefiller-ports", *[str(x.port) for x in ps],
        "--decoder-hosts", *["127.0.0.1"] * len(ds),
        "--decoder-ports", *[str(x.port) for x in ds], *extra])


@pytest.fixture
async def proxy(fake_p: FakeVLLM, fake_d: FakeVLLM) -> AsyncIterator[RunningProxy]:
    s = settings_for(fake_p, fake_d, "--read-timeout", "2")
    async with serve_proxy(nixl_proxy.create_app(s), s) as px:
        yield px


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


# --------------------------------------------------------------------------- body rules


async def test_prefill_and_decode_bodies(proxy: RunningProxy, fake_p: FakeVLLM,
                                         fake_d: FakeVLLM, client: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 7, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3, "temperature": 0.0,
            "seed": 4, "user": "u1", "kv_transfer_params": {"junk": 1}}
    status, text, _ = await post(client, proxy.url, body)
    assert status == 200
    p_body, = fake_p.bodies()
    assert p_body == {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 1,
                      "stream": False, "temperature": 0.0, "seed": 4, "user": "u1",
                      "kv_transfer_params": nixl_proxy.PREFILL_KV_TRANSFER_PARAMS}
    d_body, = fake_d.bodies()
    assert d_body == {**body, "kv_transfer_params": fake_p.returned_ktp[0]}
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 7


async def test_chat_max_completion_tokens_and_no_min_tokens_added(
        proxy: RunningProxy, fake_p: FakeVLLM, fake_d: FakeVLLM,
        client: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}],
            "max_completion_tokens": 5}
    status, answer, _ = await post(client, proxy.url, body, "chat/completions")
    assert status == 200
    assert answer["usage"]["completion_tokens"] == 5
    assert fake_p.received[0].path == fake_d.received[0].path == "/v1/chat/completions"
    p_body, d_body = fake_p.bodies()[0], fake_d.bodies()[0]
    assert p_body["max_completion_tokens"] == 1 and p_body["max_tokens"] == 1
    assert "min_tokens" not in d_body and "min_completion_tokens" not in d_body
    assert "max_tokens" not in d_body, "D gets the client's body, nothing added but KTP"
    assert d_body["max_completion_tokens"] == 5


async def test_min_tokens_kept_for_decode_only(proxy: RunningProxy, fake_p: FakeVLLM,
                                               fake_d: FakeVLLM,
                                               client: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
            "min_tokens": 4, "min_completion_tokens": 4}
    status, _, _ = await post(client, proxy.url, body, "chat/completions")
    assert status == 200, "a P that got min_tokens=4 > max_tokens=1 would answer 400"
    assert "min_tokens" not in fake_p.bodies()[0]
    assert "min_completion_tokens" not in fake_p.bodies()[0]
    assert fake_d.bodies()[0]["min_tokens"] == 4
    assert fake_d.bodies()[0]["min_completion_tokens"] == 4


async def test_client_body_without_max_tokens(proxy: RunningProxy, fake_p: FakeVLLM,
                                              fake_d: FakeVLLM,
                                              client: aiohttp.ClientSession) -> None:
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": [1, 2, 3]})
    assert status == 200
    assert answer["usage"]["completion_tokens"] == 16  # vLLM's completions default
    assert "max_tokens" not in fake_d.bodies()[0]
    assert fake_p.bodies()[0]["max_tokens"] == 1


async def test_kv_transfer_params_are_forwarded_verbatim(
        proxy: RunningProxy, fake_p: FakeVLLM, fake_d: FakeVLLM,
        client: aiohttp.ClientSession) -> None:
    for prompt in ("one", "two three", [5, 6, 7, 8]):
        status, _, _ = await post(client, proxy.url, {"model": MODEL, "prompt": prompt,
                                                  "max_tokens": 2})
        assert status == 200
    assert [b["kv_transfer_params"] for b in fake_d.bodies()] == fake_p.returned_ktp
    assert all("remote_blocks_expiry_time" in k for k in fake_p.returned_ktp)


async def test_no_kv_params_from_prefill_means_decode_recomputes(
        proxy: RunningProxy, fake_p: FakeVLLM, fake_d: FakeVLLM,
        client: aiohttp.ClientSession) -> None:
    fake_p.faults.no_kv_params = True
    body = {"model": MODEL, "prompt": "recompute me", "max_tokens": 3}
    status, answer, _ = await post(client, proxy.url, body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    assert fake_d.bodies() == [body]


async def test_decode_output_matches_a_direct_request(
        proxy: RunningProxy, fake_d: FakeVLLM, client: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": "same prompt", "max_tokens": 6}
    _, via_proxy, _ = await post(client, proxy.url, body)
    async with client.post(f"{fake_d.base_url}/completions", json=body) as r:
        direct = await r.json()
    assert via_proxy["choices"][0]["text"] == direct["choices"][0]["text"]


# --------------------------------------------------------------------------- streaming


async def test_sse_is_relayed_chunk_by_chunk(proxy: RunningProxy, fake_d: FakeVLLM,
                                             client: aiohttp.ClientSession) -> None:
    fake_d.token_latency_s = 0.3
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 5, "stream": True}
    started = time.monotonic()
    async with client.post(f"{proxy.url}/v1/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        first = await r.content.readuntil(b"\n\n")
        first_at = time.monotonic() - started
        assert fake_d.completed == 0, "the first chunk must arrive while D is still generating"
        rest = await r.read()
    assert first_at < 1.0
    events = sse_events((first + rest).decode())
    assert len(events) == 6 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


async def test_decode_error_status_reaches_client_before_streaming(
        proxy: RunningProxy, fake_d: FakeVLLM, client: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": "x" * 10, "max_tokens": 5000, "stream": True}
    status, answer, headers = await post(client, proxy.url, body)
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    assert "maximum context length" in answer["error"]["message"]
    assert fake_d.received, "D saw the request and answered the 400"


async def test_prefill_error_reaches_client_and_decode_is_not_called(
        proxy: RunningProxy, fake_p: FakeVLLM, fake_d: FakeVLLM,
        client: aiohttp.ClientSession) -> None:
    status, answer, _ = await post(client, proxy.url, {"model": "other", "prompt": "x"})
    assert status == 404
    assert answer["error"]["type"] == "NotFoundError"
    assert fake_d.received == []


async def test_decode_dies_mid_stream_gives_error_event(
        proxy: RunningProxy, fake_d: FakeVLLM, client: aiohttp.ClientSession) -> None:
    fake_d.faults.die_after_chunks = 2
    status, text, _ = await post(client, proxy.url, {"model": MODEL, "prompt": "x",
                                                 "max_tokens": 5, "stream": True})
    assert status == 200
    events = sse_events(text)
    assert len(events) == 3
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == 502


async def test_decode_dies_before_json_answer_gives_502(
        proxy: RunningProxy, fake_d: FakeVLLM, client: aiohttp.ClientSession) -> None:
    fake_d.faults.die_after_chunks = 0
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": "x"})
    assert status == 502
    assert answer["error"]["type"] == "BadGatewayError"


async def test_client_disconnect_cancels_decode(proxy: RunningProxy, fake_d: FakeVLLM,
                                                client: aiohttp.ClientSession) -> None:
    fake_d.token_latency_s = 0.2
    body = {"model": MODEL, "prompt": "bye", "max_tokens": 100, "stream": True}
    async with client.post(f"{proxy.url}/v1/completions", json=body) as r:
        await r.content.readuntil(b"\n\n")
        r.close()
    await wait_for(lambda: fake_d.cancelled == 1, what="D to see the abort")
    await wait_for(lambda: proxy.state.table.snapshot()[1]["in_flight"] == 0,
                   what="the lease on D to end")


async def test_client_disconnect_during_prefill_cancels_prefill(
        proxy: RunningProxy, fake_p: FakeVLLM, fake_d: FakeVLLM,
        client: aiohttp.ClientSession) -> None:
    fake_p.prefill_latency_s = 5
    task = asyncio.create_task(post(client, proxy.url, {"model": MODEL, "prompt": "x"}))
    await wait_for(lambda: len(fake_p.received) == 1, what="P to get the request")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_for(lambda: fake_p.cancelled == 1, what="P to see the abort")
    assert fake_d.received == []


# --------------------------------------------------------------------------- several prompts


async def direct_text(client: aiohttp.ClientSession, fake: FakeVLLM, prompt: Any,
                      max_tokens: int) -> str:
    _, answer, _ = await post(client, fake.base_url.removesuffix("/v1"),
                              {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    return str(answer["choices"][0]["text"])


async def test_several_prompts_are_split_and_merged(
        proxy: RunningProxy, fake_p: FakeVLLM, fake_d: FakeVLLM,
        client: aiohttp.ClientSession) -> None:
    prompts: list[Any] = ["one two", [5, 6, 7], "three"]
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": prompts,
                                                       "max_tokens": 3})
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert answer["usage"] == {"prompt_tokens": 2 + 3 + 1, "completion_tokens": 9,
                               "total_tokens": 15}
    assert answer["kv_transfer_params"] is None
    assert sorted(map(str, (b["prompt"] for b in fake_p.bodies()))) == sorted(map(str, prompts))
    d_bodies = fake_d.bodies()
    assert all(b["kv_transfer_params"]["remote_num_tokens"] in (1, 2, 3) for b in d_bodies)
    texts = [c["text"] for c in answer["choices"]]
    assert texts == [await direct_text(client, fake_d, p, 3) for p in prompts]
    ids = {r.headers["X-Request-Id"] for r in fake_p.received}
    assert len(ids) == 3, "each prompt is its own P/D flow"


async def test_several_prompts_streamed(proxy: RunningProxy, fake_d: FakeVLLM,
                                        client: aiohttp.ClientSession) -> None:
    fake_d.token_latency_s = 0.01
    prompts = ["alpha beta", "gamma"]
    status, text, _ = await post(client, proxy.url, {
        "model": MODEL, "prompt": prompts, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    events = sse_events(text)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 8
    by_index: dict[int, str] = {0: "", 1: ""}
    for c in chunks:
        for choice in c["choices"]:
            by_index[choice["index"]] += choice["text"]
    assert [by_index[0], by_index[1]] == [await direct_text(client, fake_d, p, 4)
                                          for p in prompts]


async def test_several_prompts_one_failing_fails_the_request(
        proxy: RunningProxy, fake_d: FakeVLLM, client: aiohttp.ClientSession) -> None:
    fake_d.max_model_len = 12
    fake_d.token_latency_s = 0.05
    for stream in (False, True):
        status, answer, _ = await post(client, proxy.url, {
            "model": MODEL, "prompt": ["short", "w " * 20], "max_tokens": 3, "stream": stream})
        assert status == 400
        assert "maximum context length" in answer["error"]["message"]
    await wait_for(lambda: all(e["in_flight"] == 0 for e in proxy.state.table.snapshot()),
                   what="every lease to end")


def test_merge_answers_with_n() -> None:
    answers: list[dict[str, Any]] = [
        {"id": "a", "choices": [{"index": 0, "text": "x"}, {"index": 1, "text": "y"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}},
               {"id": "b", "choices": [{"index": 1, "text": "z"}, {"index": 0, "text": "w"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}}]
    merged = relay.merge_answers(answers, n=2)
    assert merged["id"] == "a"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "x"), (1, "y"), (3, "z"), (2, "w")]
    assert merged["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert answers[0]["choices"][1]["index"] == 1, "inputs are not modified"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("body", "message"), [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"),
    (b'{"prompt": "x", "stream": "yes"}', "'stream' must be a boolean"),
    (b'{"prompt": "x", "max_tokens": "5"}', "'max_tokens' must be an integer"),
    (b'{"prompt": "x", "max_tokens": 4, "min_tokens": 8}',
     "min_tokens must be less than or equal to max_tokens=4, got 8."),
])
async def test_bad_bodies_get_400(proxy: RunningProxy, fake_p: FakeVLLM, body: bytes,
                                  message: str, client: aiohttp.ClientSession) -> None:
    status, answer, _ = await post(client, proxy.url, body)
    assert status == 400
    assert message in answer["error"]["message"]
    assert answer["error"]["type"] == "BadRequestError" and answer["error"]["code"] == 400
    assert fake_p.received == []


async def test_proxy_errors_are_openai_json(proxy: RunningProxy,
                                            client: aiohttp.ClientSession) -> None:
    proxy.app.config["MAX_CONTENT_LENGTH"] = 1000
    cases = [("GET", "/nope", None, 404, "NotFoundError"),
             ("GET", "/v1/completions", None, 405, "MethodNotAllowedError"),
             ("POST", "/v1/completions", b"x" * 2000, 413, "RequestEntityTooLargeError")]
    for method, path, data, status, err_type in cases:
        async with client.request(method, f"{proxy.url}{path}", data=data) as r:
            assert r.status == status
            assert r.headers["Content-Type"] == "application/json"
            body = await r.json()
        assert body["error"]["code"] == status and body["error"]["type"] == err_type
    # Still serving.
    assert (await post(client, proxy.url, {"model": MODEL, "prompt": "x"}))[0] == 200


async def test_no_instances_gives_503(client: aiohttp.ClientSession) -> None:
    s = nixl_proxy.parse_args(["--discovery-port", "1"])
    s = relay.Settings(**{**s.__dict__, "discovery_port": None})
    async with serve_proxy(nixl_proxy.create_app(s), s) as px:
        status, answer, _ = await post(client, px.url, {"model": MODEL, "prompt": "x"})
        assert status == 503
        assert answer["error"]["message"] == "no prefill instance is available"
        async with client.get(f"{px.url}/health") as r:
            assert r.status == 503
            assert (await r.json())["status"] == "unavailable"


async def test_unreachable_decode_gives_502(fake_p: FakeVLLM,
                                            client: aiohttp.ClientSession) -> None:
    dead = FakeVLLM()
    await dead.start()
    await dead.stop()
    s = settings_for(fake_p, dead)
    async with serve_proxy(nixl_proxy.create_app(s), s) as px:
        status, answer, _ = await post(client, px.url, {"model": MODEL, "prompt": "x"})
    assert status == 502
    assert "cannot connect to the decode instance" in answer["error"]["message"]


async def test_hung_prefill_gives_504(proxy: RunningProxy, fake_p: FakeVLLM,
                                      client: aiohttp.ClientSession) -> None:
    fake_p.faults.hang = True
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": "x"})
    assert status == 504
    assert answer["error"] == {"message": "prefill instance timed out",
                               "type": "GatewayTimeoutError", "code": 504}
    await wait_for(lambda: fake_p.cancelled == 1, what="P to see the abort")


async def test_prefill_non_json_answer_gives_502(fake_d: FakeVLLM,
                                                 client: aiohttp.ClientSession) -> None:
    async def not_json(_: web.Request) -> web.Response:
        return web.Response(text="<html>oops</html>")

    app = web.Application()
    app.router.add_post("/v1/completions", not_json)
    async with serve_aiohttp(app) as port:
        s = nixl_proxy.parse_args(["--prefiller-host", "127.0.0.1", "--prefiller-port",
                                   str(port), "--decoder-host", "127.0.0.1", "--decoder-port",
                                   str(fake_d.port)])
        async with serve_proxy(nixl_proxy.create_app(s), s) as px:
            status, answer, _ = await post(client, px.url, {"model": MODEL, "prompt": "x"})
    assert status == 502
    assert answer["error"]["message"] == "prefill instance answered invalid JSON"


# --------------------------------------------------------------------------- headers


async def test_request_id_is_generated_and_shared(proxy: RunningProxy, fake_p: FakeVLLM,
                                                  fake_d: FakeVLLM,
                                                  client: aiohttp.ClientSession) -> None:
    _, answer, headers = await post(client, proxy.url, {"model": MODEL, "prompt": "x"})
    rid = fake_p.received[0].headers["X-Request-Id"]
    assert str(uuid.UUID(rid)) == rid
    assert fake_d.received[0].headers["X-Request-Id"] == rid == headers["X-Request-Id"]
    assert answer["id"] == f"cmpl-{rid}"


async def test_client_request_id_and_key_are_forwarded(
        proxy: RunningProxy, fake_p: FakeVLLM, fake_d: FakeVLLM,
        client: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    headers = {"x-request-id": "client-id-1", "authorization": "Bearer client-key"}
    await post(client, proxy.url, {"model": MODEL, "prompt": "x"}, headers=headers)
    for fake in (fake_p, fake_d):
        assert fake.received[0].headers["X-Request-Id"] == "client-id-1"
        assert fake.received[0].headers["Authorization"] == "Bearer client-key"


async def test_no_key_anywhere_means_no_authorization_header(
        proxy: RunningProxy, fake_p: FakeVLLM, fake_d: FakeVLLM,
        client: aiohttp.ClientSession) -> None:
    assert proxy.state.settings.api_key is None
    await post(client, proxy.url, {"model": MODEL, "prompt": "x"})
    assert "Authorization" not in fake_p.received[0].headers
    assert "Authorization" not in fake_d.received[0].headers


async def test_proxy_key_from_environment(fake_p: FakeVLLM, fake_d: FakeVLLM,
                                          client: aiohttp.ClientSession,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-proxy")
    s = settings_for(fake_p, fake_d)
    async with serve_proxy(nixl_proxy.create_app(s), s) as px:
        await post(client, px.url, {"model": MODEL, "prompt": "x"})
    assert fake_p.received[0].headers["Authorization"] == "Bearer sk-proxy"
    assert fake_d.received[0].headers["Authorization"] == "Bearer sk-proxy"


async def test_bad_request_id_is_refused(proxy: RunningProxy, fake_p: FakeVLLM,
                                         client: aiohttp.ClientSession) -> None:
    status, answer, _ = await post(client, proxy.url, {"model": MODEL, "prompt": "x"},
                                   headers={"X-Request-Id": "x" * 300})
    assert status == 400 and "X-Request-Id" in answer["error"]["message"]
    assert fake_p.received == []


# --------------------------------------------------------------------------- info routes


async def test_info_routes(proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{proxy.url}/healthcheck") as r:
        assert await r.json() == {"status": "ok", "prefill_instances": 1, "decode_instances": 1}
    async with client.get(f"{proxy.url}/health") as r:
        assert r.status == 200
    async with client.get(f"{proxy.url}/v1/models") as r:
        assert r.status == 200
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    await post(client, proxy.url, {"model": MODEL, "prompt": "x"})
    async with client.get(f"{proxy.url}/metrics") as r:
        text = await r.text()
    assert 'pd_proxy_requests_total{route="completions",status="200"} 1.0' in text
    async with client.get(f"{proxy.url}/instances") as r:
        listing = await r.json()
    assert [i["role"] for i in listing["instances"]] == ["P", "D"] or \
        sorted(i["role"] for i in listing["instances"]) == ["D", "P"]


async def test_profile_calls_fan_out_to_every_instance(
        proxy: RunningProxy, fake_p: FakeVLLM, fake_d: FakeVLLM,
        client: aiohttp.ClientSession) -> None:
    for action in ("start_profile", "stop_profile"):
        async with client.post(f"{proxy.url}/{action}") as r:
            assert r.status == 200
            results = (await r.json())["results"]
        assert sorted(x["role"] for x in results) == ["D", "P"]
    assert [r.path for r in fake_p.received] == ["/start_profile", "/stop_profile"]
    assert [r.path for r in fake_d.received] == ["/start_profile", "/stop_profile"]
    await fake_d.stop()
    async with client.post(f"{proxy.url}/start_profile") as r:
        assert r.status == 502
        failed = [x for x in (await r.json())["results"] if x["status"] is None]
    assert [x["role"] for x in failed] == ["D"]


async def test_round_robin_over_two_decoders(fake_p: FakeVLLM,
                                             client: aiohttp.ClientSession) -> None:
    ds = [FakeVLLM(name="D1"), FakeVLLM(name="D2")]
    for d in ds:
        await d.start()
    s = settings_for(fake_p, ds)
    try:
        async with serve_proxy(nixl_proxy.create_app(s), s) as px:
            for _ in range(6):
                assert (await post(client, px.url, {"model": MODEL, "prompt": "x"}))[0] == 200
    finally:
        for d in ds:
            await d.stop()
    assert [len(d.received) for d in ds] == [3, 3]


# --------------------------------------------------------------------------- discovery


async def test_announced_instances_serve_then_expire_and_return(
        fake_p: FakeVLLM, fake_d: FakeVLLM, client: aiohttp.ClientSession,
        zctx: zmq.asyncio.Context) -> None:
    s = nixl_proxy.parse_args(["--discovery-host", "127.0.0.1", "--discovery-port", "1",
                               "--instance-ttl", "0.5"])
    s = relay.Settings(**{**s.__dict__, "discovery_port": 0})
    app = nixl_proxy.create_app(s)
    async with serve_proxy(app, s) as px:
        endpoint = px.state.listener.endpoint  # type: ignore[union-attr]
        tasks = []
        for fake, role, dialect in ((fake_p, "P", "p2p_nccl"), (fake_d, "D", "moriio_old")):
            a = registry.Announcement(role, fake.base_url, registry.Dialect(dialect),
                                      "host:127.0.0.1,handshake:7000,notify:7001")
            tasks.append(asyncio.create_task(
                registry.Announcer(a, endpoint, interval_s=0.1, ctx=zctx).run()))
        await wait_for(lambda: px.state.table.count("P") == px.state.table.count("D") == 1,
                       what="both instances announced")
        status, _, _ = await post(client, px.url, {"model": MODEL, "prompt": "x"})
        assert status == 200
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_for(lambda: px.state.table.snapshot() == [], timeout=5, what="expiry")
        assert (await post(client, px.url, {"model": MODEL, "prompt": "x"}))[0] == 503
        a = registry.Announcement("P", fake_p.base_url, registry.Dialect.MORIIO, "z")
        back = registry.Announcer(a, endpoint, ctx=zctx)
        await back.send_once()
        back.close()
        await wait_for(lambda: px.state.table.count("P") == 1, what="P to return")


# --------------------------------------------------------------------------- openai SDK


async def test_openai_sdk_through_the_proxy(proxy: RunningProxy, fake_d: FakeVLLM) -> None:
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="sk-sdk",
                                  max_retries=0) as sdk:
        comp = await sdk.completions.create(model=MODEL, prompt="hello", max_tokens=4)
        assert comp.usage is not None and comp.usage.completion_tokens == 4
        chat = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.content == fake_d_text(fake_d, chat=True)
        pieces: list[str] = []
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            pieces.extend(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage
        assert "".join(pieces) == chat.choices[0].message.content
        assert usage is not None and usage.completion_tokens == 3
        text = ""
        async for part in await sdk.completions.create(model=MODEL, prompt="hello",
                                                        max_tokens=4, stream=True):
            text += part.choices[0].text
        assert text == comp.choices[0].text
        models = await sdk.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(openai.BadRequestError):
            await sdk.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert fake_d.received[0].headers["Authorization"] == "Bearer sk-sdk"


def fake_d_text(fake_d: FakeVLLM, chat: bool) -> str:
    """What the fake generates for the last chat request it received (as D)."""
    from fake_vllm import Generation
    body = fake_d.bodies()[-1]
    gen = Generation(MODEL, body, 0, body.get("max_tokens"), False, {})
    return "".join(gen.tokens(chat)[0])


async def test_stream_body_closed_before_iteration_releases_everything(
        fake_d: FakeVLLM, client: aiohttp.ClientSession) -> None:
    """The client may vanish before Quart iterates the body: closing it must still close D's
    response (D sees the abort) and run the cleanup (the instance lease ends)."""
    fake_d.token_latency_s = 0.2
    resp = await client.post(f"{fake_d.base_url}/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True})
    released: list[bool] = []
    cleanup = contextlib.AsyncExitStack()
    cleanup.callback(released.append, True)
    body = relay.DecodeStream(resp, b"", "rid", cleanup)
    await body.aclose()
    assert released == [True]
    assert resp.closed
    await wait_for(lambda: fake_d.cancelled == 1, what="D to see the abort")
    with pytest.raises(StopAsyncIteration):
        await body.__anext__()
