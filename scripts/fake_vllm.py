"""A fake vLLM OpenAI server that behaves like vLLM on the wire, for tests and the demo.

It serves ``/v1/completions`` and ``/v1/chat/completions`` (JSON and SSE in vLLM's chunk shapes,
``usage`` with ``stream_options.include_usage``, ``finish_reason``, ``data: [DONE]``), ``/health``
and ``/v1/models``, and validates what vLLM validates (stream_options without stream, min_tokens
above max_tokens, a token budget beyond the model length, an unknown model).

KV transfer, as the connectors do it:
- a request with ``kv_transfer_params.do_remote_decode`` is a prefill: the answer carries
  connector-shaped ``kv_transfer_params`` (NIXL or MoRIIO), including values the proxy cannot
  know in advance (engine id, block ids, expiry time);
- a request with ``do_remote_prefill`` is a decode: the params are checked and a 400 names
  whatever is missing or inconsistent, so a proxy bug fails loudly.

Everything received is recorded (``FakeVLLM.received``; counts by kind at ``GET /fake/stats``)
and faults can be injected
(``FakeVLLM.faults``): answer an error, die mid-stream, hang. It can announce itself to a proxy's
discovery socket in any dialect.

Run alone: ``python scripts/fake_vllm.py --port 8100 --announce 127.0.0.1:36367 --role P``.
Tokens are whitespace-separated words; the generated text depends on the prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from aiohttp import web
from multidict import CIMultiDict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import registry

logger = logging.getLogger("fake_vllm")

DEFAULT_MODEL: Final = "fake-model"
DEFAULT_MAX_MODEL_LEN: Final = 2048
#: vLLM's default max_tokens for /v1/completions.
COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16
#: Without a budget, chat "meets EOS" after this many tokens unless ignore_eos is set.
CHAT_EOS_AFTER_TOKENS: Final = 20
#: Per-message overhead of the (imaginary) chat template, in tokens.
CHAT_TEMPLATE_TOKENS: Final = 4
#: NIXL keeps a prefilled request's blocks this long for D to read.
NIXL_BLOCKS_EXPIRY_S: Final = 480
BLOCK_SIZE_TOKENS: Final = 16


class FakeError(Exception):
    """A request vLLM would refuse; becomes vLLM's JSON error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Received:
    """One request as the fake saw it."""

    path: str
    headers: CIMultiDict[str]  # case-insensitive, as HTTP headers are
    body: Any
    at: float


@dataclass
class Faults:
    """Fault injection; tests set these fields directly, the CLI through flags."""

    status: int | None = None  # answer this HTTP status with a vLLM error body
    die_after_chunks: int | None = None  # drop the connection after N SSE chunks (0: before any)
    hang: bool = False  # accept the request and never answer
    no_kv_params: bool = False  # as P, return no kv_transfer_params


@dataclass
class FakeVLLM:
    """One fake vLLM instance. ``start()`` serves it on a port (0 picks a free one)."""

    model: str = DEFAULT_MODEL
    connector: str = "nixl"  # or "moriio"
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    prefill_latency_s: float = 0.0
    token_latency_s: float = 0.0
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    name: str = "fake"
    zmq_address: str = ""  # MoRIIO side channel; a loopback default is made at start()
    transfer_mode: str | None = None  # MoRIIO: READ or WRITE
    dp_size: int = 1
    tp_size: int = 1
    received: list[Received] = field(default_factory=list)
    faults: Faults = field(default_factory=Faults)
    returned_ktp: list[dict[str, Any]] = field(default_factory=list)
    keep_received: bool = True  # False for long runs (demo, benchmark): counts only
    counts: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0,
                                                            "plain": 0})
    cancelled: int = 0
    completed: int = 0
    completed_at: list[float] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    base_url: str = ""
    port: int = 0

    # ---------------------------------------------------------------- serving

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/fake/stats", self._stats)
        app.router.add_post("/start_profile", self._profile)
        app.router.add_post("/stop_profile", self._profile)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve and return the base URL (``http://host:port/v1``)."""
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://{host}:{self.port}/v1"
        self.zmq_address = self.zmq_address or (
            f"host:{host},handshake:{20000 + self.port % 20000},notify:{40000 + self.port % 20000}")
        return self.base_url

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def bodies(self, path_suffix: str = "") -> list[Any]:
        """Bodies received on paths ending with ``path_suffix``."""
        return [r.body for r in self.received if r.path.endswith(path_suffix)]

    # ---------------------------------------------------------------- handlers

    async def _profile(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.path, CIMultiDict(request.headers), None,
                                      time.monotonic()))
        return web.Response(status=200)

    async def _stats(self, _: web.Request) -> web.Response:
        return web.json_response(self.counts)

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": int(time.time()),
            "owned_by": "vllm", "root": self.model, "parent": None,
            "max_model_len": self.max_model_len, "permission": []}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            body = raw.decode("utf-8", "replace")
        if self.keep_received:
            self.received.append(Received(request.path, CIMultiDict(request.headers), body,
                                          time.monotonic()))
        self._count(body)
        try:
            return await self._answer(request, body, chat)
        except FakeError as exc:
            return _error(exc.status, exc.message)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def _answer(self, request: web.Request, body: Any, chat: bool) -> web.StreamResponse:
        if self.faults.hang:
            await asyncio.Event().wait()
        await asyncio.sleep(self.prefill_latency_s)
        if self.faults.status is not None:
            raise FakeError(self.faults.status, f"injected fault {self.faults.status}")
        gen = self._validate(body, chat)
        gen.request_id = ("chatcmpl-" if chat else "cmpl-") + (
            request.headers.get("X-Request-Id") or uuid.uuid4().hex)
        if self.connector == "moriio" and gen.ktp:
            problem = _check_moriio_request_id(request.headers.get("X-Request-Id", ""),
                                               gen.ktp, self.zmq_address)
            if problem:
                raise FakeError(400, f"request id: {problem}")
        ktp_out = self._kv_transfer(gen)
        if ktp_out is not None:
            self.returned_ktp.append(ktp_out)
        if gen.stream:
            return await self._stream(request, gen, chat)
        if self.faults.die_after_chunks is not None:
            _abort(request)
        self._done()
        return web.json_response(gen.full_answer(chat, ktp_out))

    def _count(self, body: Any) -> None:
        ktp = body.get("kv_transfer_params") if isinstance(body, dict) else None
        ktp = ktp if isinstance(ktp, dict) else {}
        kind = ("prefill" if ktp.get("do_remote_decode") else
                "decode" if ktp.get("do_remote_prefill") else "plain")
        self.counts[kind] += 1

    def _done(self) -> None:
        self.completed += 1
        self.completed_at.append(time.monotonic())

    # ---------------------------------------------------------------- validation

    def _validate(self, body: Any, chat: bool) -> Generation:
        if not isinstance(body, dict):
            raise FakeError(400, "request body must be a JSON object")
        if body.get("model", self.model) != self.model:
            raise FakeError(404, f"The model `{body.get('model')}` does not exist.")
        stream = body.get("stream") is True
        if body.get("stream_options") is not None and not stream:
            raise FakeError(400, "Stream options can only be defined when `stream=True`.")
        prompt_tokens = _prompt_tokens(body, chat)
        budget = body.get("max_completion_tokens") if chat else None
        budget = budget if budget is not None else body.get("max_tokens")
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise FakeError(400, f"max_tokens must be at least 1, got {budget}.")
        if budget is not None and prompt_tokens + budget > self.max_model_len:
            raise FakeError(400, f"This model's maximum context length is {self.max_model_len} "
                            f"tokens. However, you requested {prompt_tokens + budget} tokens "
                            f"({prompt_tokens} in the messages, {budget} in the completion).")
        min_tokens = body.get("min_tokens") or 0
        if budget is not None and min_tokens > budget:
            raise FakeError(400, f"min_tokens must be less than or equal to max_tokens={budget}, "
                            f"got {min_tokens}.")
        ktp = body.get("kv_transfer_params")
        if ktp is not None and not isinstance(ktp, dict):
            raise FakeError(400, "kv_transfer_params must be an object")
        return Generation(self.model, body, prompt_tokens, budget, stream, ktp or {})

    def _kv_transfer(self, gen: Generation) -> dict[str, Any] | None:
        """As P: the params to return. As D: check the params received."""
        if gen.ktp.get("do_remote_prefill"):
            problem = (_check_nixl_decode(gen.ktp, gen.prompt_tokens) if self.connector == "nixl"
                       else _check_moriio_decode(gen.ktp, self.transfer_mode))
            if problem:
                raise FakeError(400, f"kv_transfer_params: {problem}")
        if not gen.ktp.get("do_remote_decode") or self.faults.no_kv_params:
            return None
        if gen.stream:
            return None  # vLLM puts no kv_transfer_params on streamed chunks
        return (self._nixl_prefill_params if self.connector == "nixl"
                else self._moriio_prefill_params)(gen)

    def _nixl_prefill_params(self, gen: Generation) -> dict[str, Any]:
        return {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [_block_ids(gen.prompt_tokens)],
            "remote_engine_id": self.engine_id, "remote_request_id": gen.request_id,
            "remote_host": "127.0.0.1", "remote_port": 5600 + self.port % 1000,
            "tp_size": self.tp_size, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": gen.prompt_tokens,
            "remote_blocks_expiry_time": time.time() + NIXL_BLOCKS_EXPIRY_S,
            "transfer_mode": "pull", "remote_prefill_cached_tokens": 0,
        }

    def _moriio_prefill_params(self, gen: Generation) -> dict[str, Any]:
        return {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": _block_ids(gen.prompt_tokens),
            "remote_engine_id": self.engine_id, "remote_host": "127.0.0.1",
            "remote_port": self.port, "transfer_id": gen.ktp.get("transfer_id"),
            "tp_size": self.tp_size, "remote_num_tokens": gen.prompt_tokens,
        }

    # ---------------------------------------------------------------- streaming

    async def _stream(self, request: web.Request, gen: Generation,
                      chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        sent = 0
        async for event in gen.events(chat):
            if self.faults.die_after_chunks is not None and sent >= self.faults.die_after_chunks:
                _abort(request)
            await resp.write(event)
            sent += 1
            await asyncio.sleep(self.token_latency_s)
        await resp.write_eof()
        self._done()
        return resp


def _abort(request: web.Request) -> None:
    """Drop the connection without finishing the response (a crashed server)."""
    if request.transport is not None:
        request.transport.abort()
    raise asyncio.CancelledError


def _error(status: int, message: str) -> web.Response:
    kinds = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}
    return web.json_response({"error": {"message": message, "type": kinds.get(
        status, "Error"), "param": None, "code": status}}, status=status)


def _words(text: str) -> int:
    return max(1, len(text.split()))


def _prompt_tokens(body: Mapping[str, Any], chat: bool) -> int:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise FakeError(400, "messages must be a non-empty list")
        return sum(CHAT_TEMPLATE_TOKENS + _words(_content_text(m)) for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _words(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt_tokens({"prompt": prompt[0]}, chat=False)
    if isinstance(prompt, list) and prompt:
        raise FakeError(400, "this fake serves one prompt per request")
    raise FakeError(400, "prompt must be a string or a list of token ids")


def _content_text(message: Any) -> str:
    if not isinstance(message, dict):
        raise FakeError(400, "each message must be an object")
    content = message.get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _block_ids(prompt_tokens: int) -> list[int]:
    return list(range(1, (prompt_tokens + BLOCK_SIZE_TOKENS - 1) // BLOCK_SIZE_TOKENS + 1))


def _check_nixl_decode(ktp: Mapping[str, Any], prompt_tokens: int) -> str | None:
    for name, kind in (("remote_engine_id", str), ("remote_block_ids", list),
                       ("remote_host", str), ("remote_port", int), ("remote_request_id", str)):
        if not isinstance(ktp.get(name), kind):
            return f"{name} missing or not a {kind.__name__}"
    if not ktp["remote_block_ids"]:
        return "remote_block_ids is empty"
    if ktp.get("remote_num_tokens", prompt_tokens) != prompt_tokens:
        return (f"P prefilled {ktp['remote_num_tokens']} tokens but this prompt has "
                f"{prompt_tokens}: the KV belongs to another request")
    return None


def _check_moriio_decode(ktp: Mapping[str, Any], mode: str | None) -> str | None:
    if not isinstance(ktp.get("transfer_id"), str) or not ktp["transfer_id"].startswith("tx-"):
        return "transfer_id missing"
    for name in ("remote_host", "remote_handshake_port", "remote_notify_port", "tp_size",
                 "remote_dp_size", "remote_tp_size"):
        if ktp.get(name) is None:
            return f"{name} missing"
    if mode != "WRITE":
        if not isinstance(ktp.get("remote_engine_id"), str):
            return "READ mode needs remote_engine_id"
        if not ktp.get("remote_block_ids"):
            return "READ mode needs non-empty remote_block_ids"
    return None


MORIIO_REQUEST_ID = re.compile(r"___prefill_addr_(.+)___decode_addr_(.+)_([0-9a-f]{32})")


def _check_moriio_request_id(rid: str, ktp: Mapping[str, Any], own: str) -> str | None:
    """The connector parses peers out of the request id: check it names this instance."""
    match = MORIIO_REQUEST_ID.fullmatch(rid)
    if match is None:
        return f"{rid!r} is not ___prefill_addr_P___decode_addr_D_<32 hex>"
    prefill_addr, decode_addr, _ = match.groups()
    mine, peer = ((prefill_addr, decode_addr) if ktp.get("do_remote_decode")
                  else (decode_addr, prefill_addr))
    if mine != own:
        return f"names {mine!r} for this instance, which is {own!r}"
    parts = dict(p.split(":", 1) for p in peer.split(",") if ":" in p)
    expected = {"remote_host": parts.get("host"), "remote_handshake_port": parts.get(
        "handshake"), "remote_notify_port": parts.get("notify")}
    for name, value in expected.items():
        if name in ktp and str(ktp[name]) != value:
            return f"{name}={ktp[name]!r} but the request id's peer has {value!r}"
    return None


@dataclass
class Generation:
    """One request's generation: deterministic words that depend on the prompt."""

    model: str
    body: Mapping[str, Any]
    prompt_tokens: int
    budget: int | None
    stream: bool
    ktp: Mapping[str, Any]
    request_id: str = ""

    def tokens(self, chat: bool) -> tuple[list[str], str]:
        """The generated tokens and the finish reason."""
        if self.budget is not None:
            n, reason = self.budget, "length"
        elif chat:
            n, reason = CHAT_EOS_AFTER_TOKENS, "stop"
        else:
            n, reason = COMPLETIONS_DEFAULT_MAX_TOKENS, "length"
        if chat and self.budget is not None and not self.body.get("ignore_eos") and (
                n > CHAT_EOS_AFTER_TOKENS):
            n, reason = CHAT_EOS_AFTER_TOKENS, "stop"
        seed = hashlib.sha256(json.dumps(self.body.get("messages") or self.body.get("prompt"),
                                         sort_keys=True).encode()).digest()
        return [f" w{(seed[i % 32] + 7 * i) % 100}" for i in range(n)], reason

    def usage(self, completion_tokens: int) -> dict[str, int]:
        """OpenAI usage block."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _head(self, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if chat else "text_completion") + (
            ".chunk" if chunk and chat else "")
        return {"id": self.request_id, "object": kind, "created": int(time.time()),
                "model": self.model}

    def full_answer(self, chat: bool, ktp: dict[str, Any] | None) -> dict[str, Any]:
        """The non-streaming JSON answer."""
        tokens, reason = self.tokens(chat)
        text = "".join(tokens)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason,
                                  "stop_reason": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": [],
                                 "reasoning_content": None}
        else:
            choice.update(text=text, prompt_logprobs=None)
        return {**self._head(chat, False), "choices": [choice],
                "usage": self.usage(len(tokens)), "prompt_logprobs": None,
                "kv_transfer_params": ktp}

    async def events(self, chat: bool) -> AsyncIterator[bytes]:
        """SSE events as vLLM sends them, ending with ``data: [DONE]``."""
        tokens, reason = self.tokens(chat)
        if chat:
            yield _sse({**self._head(chat, True), "choices": [{"index": 0, "delta": {
                "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        for i, tok in enumerate(tokens):
            last = i == len(tokens) - 1
            choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                      "finish_reason": reason if last else None,
                                      "stop_reason": None}
            choice.update({"delta": {"content": tok}} if chat else {"text": tok})
            yield _sse({**self._head(chat, True), "choices": [choice]})
        options = self.body.get("stream_options") or {}
        if options.get("include_usage"):
            yield _sse({**self._head(chat, True), "choices": [],
                        "usage": self.usage(len(tokens))})
        yield b"data: [DONE]\n\n"


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The fake's command line."""
    p = argparse.ArgumentParser(prog="fake_vllm.py", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--connector", choices=["nixl", "moriio"], default="nixl")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument("--prefill-latency-ms", type=float, default=0.0)
    p.add_argument("--token-latency-ms", type=float, default=0.0)
    p.add_argument("--role", choices=["P", "D"], help="role to announce")
    p.add_argument("--announce", metavar="HOST:PORT", help="proxy discovery address")
    p.add_argument("--dialect", choices=[d.value for d in registry.Dialect], default="moriio")
    p.add_argument("--zmq-address", default=None,
                   help="announced zmq_address (default host:H,handshake:N,notify:M)")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--transfer-mode", choices=["READ", "WRITE"], default=None)
    p.add_argument("--announce-interval", type=float, default=registry.DEFAULT_ANNOUNCE_INTERVAL_S)
    p.add_argument("--fail-status", type=int, default=None, help="answer every request so")
    p.add_argument("--die-after-chunks", type=int, default=None)
    p.add_argument("--port-file", help="write the chosen port here once serving")
    return p


def announcement_for(fake: FakeVLLM, role: str, dialect: str) -> registry.Announcement:
    """What this fake announces, from its own fields."""
    return registry.Announcement(role=role, base_url=fake.base_url,
                                 dialect=registry.Dialect(dialect),
                                 zmq_address=fake.zmq_address, dp_size=fake.dp_size,
                                 tp_size=fake.tp_size, transfer_mode=fake.transfer_mode)


async def _main(ns: argparse.Namespace) -> None:
    fake = FakeVLLM(model=ns.model, connector=ns.connector, max_model_len=ns.max_model_len,
                    prefill_latency_s=ns.prefill_latency_ms / 1000,
                    token_latency_s=ns.token_latency_ms / 1000,
                    faults=Faults(status=ns.fail_status, die_after_chunks=ns.die_after_chunks),
                    zmq_address=ns.zmq_address or "", transfer_mode=ns.transfer_mode,
                    dp_size=ns.dp_size, tp_size=ns.tp_size, keep_received=False)
    url = await fake.start(ns.host, ns.port)
    if ns.port_file:
        Path(ns.port_file).write_text(str(fake.port))  # noqa: ASYNC240 - once, tiny
    logger.info("fake vLLM serving %s at %s", ns.model, url)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    task: asyncio.Task[None] | None = None
    if ns.announce:
        ann = announcement_for(fake, ns.role, ns.dialect)
        task = asyncio.create_task(registry.Announcer(ann, ns.announce,
                                                      ns.announce_interval).run())
    try:
        await stop.wait()
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await fake.stop()


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.announce and not ns.role:
        parser.error("--announce needs --role P or D")
    logging.basicConfig(level=os.environ.get("FAKE_VLLM_LOG", "INFO"),
                        format="%(asctime)s %(levelname)s fake_vllm[%(process)d]: %(message)s")
    asyncio.run(_main(ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
