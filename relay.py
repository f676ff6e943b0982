"""The HTTP side both P/D proxies share.

- settings and the command-line flags common to both proxies;
- the Quart app skeleton (``create_base_app``) with the common routes (completions, chat,
  health, healthcheck, models, instances, metrics, profile fan-out) and the serving hooks that
  own the pooled upstream session, the discovery listener and its task;
- completions with several prompts: one flow per prompt, answers merged (``serve_prompts``);
- the upstream legs: ``call_prefill`` (JSON) and ``decode_leg`` (relayed to the client as it
  arrives), and ``Supervised`` for a prefill that runs beside the decode;
- the one error mapping (PROTOCOL.md section 4, STYLE.md section 2.7);
- request ids, Authorization, the prefill body rules of PROTOCOL.md section 2;
- ``serve`` with hypercorn and a shutdown trigger.

A proxy script supplies only a ``Flow``: the coroutine that turns one validated client request
into a Quart response by calling P and D in its connector's order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import aiohttp
import prometheus_client
import uvloop
import zmq
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

import registry
from registry import InstanceTable, NoInstanceError, Policy

logger = logging.getLogger(__name__)
T = TypeVar("T")

EXTENSION_KEY: Final = "pd_proxy"
ROUTES: Final = {"/v1/completions": "completions", "/v1/chat/completions": "chat/completions"}

#: Connecting to an instance on the same network takes milliseconds; 10 s means it is gone.
DEFAULT_CONNECT_TIMEOUT_S: Final = 10.0
#: Longest silence allowed from an upstream: the whole prefill, a non-streamed generation, or
#: the gap between two streamed chunks. Long prompts on a busy server take minutes.
DEFAULT_READ_TIMEOUT_S: Final = 600.0
#: Seconds hypercorn lets in-flight requests finish after a shutdown signal.
GRACEFUL_TIMEOUT_S: Final = 10.0
KEEP_ALIVE_TIMEOUT_S: Final = 75.0
LISTEN_BACKLOG: Final = 1024
MAX_REQUEST_BYTES: Final = 64 * 1024 * 1024
MAX_REQUEST_ID_CHARS: Final = 256
UPSTREAM_POOL_LIMIT: Final = 0  # no cap: vLLM queues requests itself
#: After D's answer, how long a concurrent prefill may still take before it is cancelled.
SUPERVISED_GRACE_S: Final = 2.0

PREFILL_DROPPED_FIELDS: Final = ("stream_options", "min_tokens", "min_completion_tokens")


# --------------------------------------------------------------------------- settings and CLI


@dataclass(frozen=True)
class Settings:
    """Everything a proxy process is configured with."""

    host: str
    port: int
    discovery_host: str | None = None
    discovery_port: int | None = None
    instance_ttl_s: float = registry.DEFAULT_INSTANCE_TTL_S
    policy: Policy = Policy.ROUND_ROBIN
    log_level: str = "INFO"
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    api_key: str | None = None
    event_loop: str = "uvloop"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0: {text!r}")
    return value


def port_number(text: str) -> int:
    """argparse type: a TCP port (1-65535)."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port (1-65535): {text!r}")
    return int(text)


def add_common_args(parser: argparse.ArgumentParser, *, host: str, port: int) -> None:
    """Flags both proxies take (timeouts, policy, TTL, logging)."""
    parser.add_argument("--host", default=host, help=f"HTTP bind address (default {host})")
    parser.add_argument("--port", type=port_number, default=port,
                        help=f"HTTP port (default {port})")
    parser.add_argument("--instance-ttl", type=_positive_float,
                        default=registry.DEFAULT_INSTANCE_TTL_S, metavar="SECONDS",
                        help="drop an announced instance after this much silence (default 15)")
    parser.add_argument("--policy", choices=[p.value for p in Policy],
                        default=Policy.ROUND_ROBIN.value,
                        help="how instances of a role are chosen (default round_robin)")
    parser.add_argument("--connect-timeout", type=_positive_float,
                        default=DEFAULT_CONNECT_TIMEOUT_S, metavar="SECONDS",
                        help="upstream connect timeout (default 10)")
    parser.add_argument("--read-timeout", type=_positive_float, default=DEFAULT_READ_TIMEOUT_S,
                        metavar="SECONDS", help="longest upstream silence: a whole prefill, a "
                        "non-streamed answer, or a gap between chunks (default 600)")
    parser.add_argument("--event-loop", choices=["uvloop", "asyncio"], default="uvloop",
                        help="event loop implementation (default uvloop, faster; see "
                             "BENCHMARKS.md)")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default INFO)")


def common_settings(ns: argparse.Namespace, **extra: Any) -> Settings:
    """Settings from parsed common flags plus connector-specific fields."""
    return Settings(
        host=ns.host, port=ns.port, instance_ttl_s=ns.instance_ttl, policy=Policy(ns.policy),
        log_level=ns.log_level, connect_timeout_s=ns.connect_timeout,
        read_timeout_s=ns.read_timeout, api_key=os.environ.get("OPENAI_API_KEY") or None,
        event_loop=ns.event_loop, **extra,
    )


def configure_logging(level: str) -> None:
    """Process-wide logging; called from ``main()`` only."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# --------------------------------------------------------------------------- errors


class ProxyError(Exception):
    """An error the proxy itself answers, OpenAI-style."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError",
                 leg: str = "proxy") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.leg = leg


class UpstreamHTTPError(Exception):
    """An instance answered an error status before any byte reached the client."""

    def __init__(self, leg: str, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"{leg} answered HTTP {status}")
        self.leg = leg
        self.status = status
        self.body = body
        self.content_type = content_type


def error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    """OpenAI's error shape, as vLLM answers it."""
    return {"error": {"message": message, "type": err_type, "code": status}}


def error_response(status: int, message: str, err_type: str) -> Response:
    """A JSON error response in OpenAI's shape."""
    return Response(json.dumps(error_body(status, message, err_type)), status=status,
                    content_type="application/json")


def map_error(exc: BaseException, leg: str) -> ProxyError | UpstreamHTTPError:
    """The one mapping from a failure before the first byte to what the client gets."""
    if isinstance(exc, (ProxyError, UpstreamHTTPError)):
        return exc
    if isinstance(exc, NoInstanceError):
        return ProxyError(503, str(exc), "ServiceUnavailableError",
                          "prefill" if exc.role == "P" else "decode")
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return ProxyError(504, f"{leg} instance timed out", "GatewayTimeoutError", leg)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ProxyError(502, f"cannot connect to the {leg} instance: {exc.os_error}",
                          "BadGatewayError", leg)
    if isinstance(exc, aiohttp.ClientError):
        return ProxyError(502, f"{leg} instance failed: {type(exc).__name__}: {exc}",
                          "BadGatewayError", leg)
    raise exc


def response_for(err: ProxyError | UpstreamHTTPError) -> Response:
    """The client's response for a mapped error."""
    if isinstance(err, UpstreamHTTPError):
        return Response(err.body, status=err.status, content_type=err.content_type)
    return error_response(err.status, err.message, err.err_type)


def sse_error_event(message: str, status: int = 502) -> bytes:
    """The final SSE event when the stream broke after it started (never a clean [DONE])."""
    return b"data: " + json.dumps(error_body(status, message, "BadGatewayError")).encode() + b"\n\n"


UPSTREAM_ERRORS: Final = (aiohttp.ClientError, asyncio.TimeoutError)


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ClientRequest:
    """A validated client request, trusted from here on."""

    route: str  # "completions" or "chat/completions"
    body: Mapping[str, Any]
    request_id: str
    authorization: str | None

    @property
    def stream(self) -> bool:
        """Whether the client asked for SSE."""
        return self.body.get("stream") is True


def parse_body(raw: bytes) -> dict[str, Any]:
    """Client body -> JSON object, or a 400 naming the problem."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProxyError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProxyError(400, f"request body must be a JSON object, not {type(body).__name__}")
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise ProxyError(400, "'stream' must be a boolean")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ProxyError(400, f"{name!r} must be an integer")
    return body


def prompt_count(body: Mapping[str, Any]) -> int:
    """How many prompts a completions body carries (string, tokens, or lists of either)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def check_route_body(route: str, body: Mapping[str, Any]) -> None:
    """Refuse what no P/D flow can serve correctly."""
    check_min_tokens(route, body)


def check_min_tokens(route: str, body: Mapping[str, Any]) -> None:
    """vLLM's ``min_tokens <= max_tokens`` rule, checked before P is called.

    P never sees min_tokens (PROTOCOL.md section 2), so only D would reject it, after P has
    prefilled and while P holds the KV. Worse, vLLM 0.32's D answered 400 yet still pulled
    that KV and stalled later requests until P's lease expired (seen here with real vLLM).
    """
    budget = body.get("max_completion_tokens") if route == "chat/completions" else None
    budget = budget if budget is not None else body.get("max_tokens")
    min_tokens = body.get("min_tokens")
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool):
        return
    if isinstance(budget, int) and min_tokens > budget:
        raise ProxyError(400, f"min_tokens must be less than or equal to max_tokens={budget}, "
                         f"got {min_tokens}.")


def request_id_from(given: str | None) -> str:
    """The client's X-Request-Id when it sent a sane one, else a fresh uuid."""
    if given is None or given == "":
        return str(uuid.uuid4())
    if len(given) > MAX_REQUEST_ID_CHARS or not given.isascii() or not given.isprintable():
        raise ProxyError(400, f"X-Request-Id must be printable ASCII of at most "
                         f"{MAX_REQUEST_ID_CHARS} characters")
    return given


def upstream_headers(req: ClientRequest, api_key: str | None,
                     extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Headers for either leg: request id, and the client's key, else ours, else none."""
    headers = {"X-Request-Id": req.request_id}
    if req.authorization:
        headers["Authorization"] = req.authorization
    elif api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    headers.update(extra or {})
    return headers


def prefill_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The P copy of a client body (PROTOCOL.md section 2); the original is left untouched."""
    # A shallow copy is enough: only top-level keys change, nested values are sent as they are.
    p = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
    p["stream"] = False
    p["max_tokens"] = 1
    if "max_completion_tokens" in body:
        p["max_completion_tokens"] = 1
    p["kv_transfer_params"] = dict(kv_transfer_params)
    return p


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None
                ) -> dict[str, Any]:
    """The D copy: the client's body as sent, plus KTP when there are any."""
    d = dict(body)
    d.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        d["kv_transfer_params"] = kv_transfer_params
    return d


# --------------------------------------------------------------------------- state


@dataclass
class Metrics:
    """Prometheus metrics of one proxy process (a registry of its own, not the global one)."""

    registry: prometheus_client.CollectorRegistry = field(
        default_factory=prometheus_client.CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = prometheus_client.Counter(
            "pd_proxy_requests", "Client requests by route and status", ["route", "status"],
            registry=r)
        self.leg_failures = prometheus_client.Counter(
            "pd_proxy_leg_failures", "Upstream failures by leg and kind", ["leg", "kind"],
            registry=r)
        self.prefill_seconds = prometheus_client.Histogram(
            "pd_proxy_prefill_seconds", "Time to P's complete answer", registry=r)
        self.in_flight = prometheus_client.Gauge(
            "pd_proxy_in_flight", "Client requests being served", registry=r)


@dataclass
class ProxyState:
    """What one proxy app owns: settings, instance table, upstream session, listener, metrics."""

    settings: Settings
    table: InstanceTable
    metrics: Metrics = field(default_factory=Metrics)
    listener: registry.DiscoveryListener | None = None
    _session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled upstream session (exists while serving)."""
        if self._session is None:
            raise RuntimeError("the upstream session exists only while the app is serving")
        return self._session

    def timeout(self, read_s: float | None = None) -> aiohttp.ClientTimeout:
        """Named timeouts: connect, and the longest upstream silence (no total)."""
        s = self.settings
        return aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout_s,
                                     sock_read=read_s or s.read_timeout_s)


def state_of(app: Quart) -> ProxyState:
    """The proxy state owned by ``app``."""
    st: ProxyState = app.extensions[EXTENSION_KEY]
    return st


Flow = Callable[[ProxyState, ClientRequest], Awaitable[Response]]


# --------------------------------------------------------------------------- upstream legs


async def read_json_object(resp: aiohttp.ClientResponse, leg: str) -> dict[str, Any]:
    """An upstream's 2xx body as a JSON object; anything else is a 502."""
    raw = await resp.read()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ProxyError(502, f"{leg} instance answered invalid JSON", "BadGatewayError",
                         leg) from None
    if not isinstance(data, dict):
        raise ProxyError(502, f"{leg} instance answered a JSON {type(data).__name__}",
                         "BadGatewayError", leg)
    return data


async def raise_for_upstream(resp: aiohttp.ClientResponse, leg: str) -> None:
    """Turn an upstream error status into UpstreamHTTPError, carrying its body as is."""
    if resp.status < 400:
        return
    body = await resp.read()
    ctype = resp.headers.get("Content-Type", "application/json")
    raise UpstreamHTTPError(leg, resp.status, body, ctype)


async def call_prefill(st: ProxyState, url: str, body: Mapping[str, Any],
                       headers: Mapping[str, str]) -> dict[str, Any]:
    """POST the P leg and return P's complete JSON answer."""
    started = time.monotonic()
    try:
        async with st.session.post(url, json=body, headers=headers,
                                   timeout=st.timeout()) as resp:
            await raise_for_upstream(resp, "prefill")
            data = await read_json_object(resp, "prefill")
    except UPSTREAM_ERRORS as exc:
        raise map_error(exc, "prefill") from exc
    st.metrics.prefill_seconds.observe(time.monotonic() - started)
    return data


async def _open_decode(st: ProxyState, url: str, body: Mapping[str, Any],
                       headers: Mapping[str, str]) -> aiohttp.ClientResponse:
    try:
        resp = await st.session.post(url, json=body, headers=headers, timeout=st.timeout())
    except UPSTREAM_ERRORS as exc:
        raise map_error(exc, "decode") from exc
    try:
        await raise_for_upstream(resp, "decode")
    except UPSTREAM_ERRORS as exc:
        resp.close()
        raise map_error(exc, "decode") from exc
    except BaseException:
        resp.close()
        raise
    return resp


class Supervised:
    """A leg running beside the decode (MoRIIO WRITE's prefill) that must never be lost.

    Until D produced output, its failure is the client's answer (see ``first_of``); after
    that, ``finish`` logs and counts it. ``finish`` always cancels and awaits the task.
    """

    def __init__(self, st: ProxyState, leg: str, request_id: str,
                 coro: Awaitable[Any]) -> None:
        self.task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self.st, self.leg, self.request_id = st, leg, request_id
        self.reported = False
        self.decode_output = False

    async def first_of(self, work: Awaitable[T]) -> T:
        """``work``'s result; if this leg fails first, cancel ``work`` and raise the failure."""
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait({task, self.task}, return_when=asyncio.FIRST_COMPLETED)
            failure = self._failure()
            if not task.done() and failure is not None:
                self.reported = True
                raise failure
            return await task
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _failure(self) -> BaseException | None:
        if not self.task.done() or self.task.cancelled():
            return None
        return self.task.exception()

    async def finish(self) -> None:
        """Let the leg end (briefly, once D answered), cancel it if it still runs, and log a
        failure nobody saw."""
        if not self.task.done() and self.decode_output:
            await asyncio.wait({self.task}, timeout=SUPERVISED_GRACE_S)
        self.task.cancel()
        result = (await asyncio.gather(self.task, return_exceptions=True))[0]
        if isinstance(result, Exception) and not self.reported:
            logger.warning("[%s] %s failed after decode produced output: %s", self.request_id,
                           self.leg, result)
            self.st.metrics.leg_failures.labels(self.leg, "after_decode_output").inc()


async def _guarded(guard: Supervised | None, work: Awaitable[T]) -> T:
    return await (guard.first_of(work) if guard is not None else work)


async def _read_first(resp: aiohttp.ClientResponse, stream: bool) -> bytes:
    """The first SSE bytes, or the whole JSON body."""
    try:
        return await (resp.content.readany() if stream else resp.read())
    except UPSTREAM_ERRORS as exc:
        raise map_error(exc, "decode") from exc


async def decode_leg(st: ProxyState, req: ClientRequest, url: str, body: Mapping[str, Any],
                     headers: Mapping[str, str], *, cleanup: contextlib.AsyncExitStack,
                     guard: Supervised | None = None) -> Response:
    """Send D and relay its answer: SSE chunk by chunk when streaming, else the JSON body.

    The status is decided from D's status before any byte goes out: an error status becomes
    UpstreamHTTPError. ``cleanup`` is closed when the relay ends, however it ends (client gone
    included). With a ``guard``, a failure of that leg before D's first bytes is raised instead.
    """
    try:
        resp = await _guarded(guard, _open_decode(st, url, body, headers))
        try:
            first = await _guarded(guard, _read_first(resp, req.stream))
        except BaseException:
            resp.close()
            raise
    except BaseException:
        await cleanup.aclose()
        raise
    if guard is not None:
        guard.decode_output = True
    ctype = resp.headers.get("Content-Type", "application/json")
    out_headers = {"X-Request-Id": req.request_id}
    if not req.stream:
        resp.close()
        await cleanup.aclose()
        return Response(first, status=resp.status, content_type=ctype, headers=out_headers)
    out = Response(DecodeStream(resp, first, req.request_id, cleanup), status=resp.status,
                   content_type=ctype, headers=out_headers)
    out.timeout = None  # a long generation is not a hung response; idle reads are timed instead
    return out


class DecodeStream:
    """D's SSE answer relayed chunk by chunk, as a Quart response body.

    An iterator object rather than an async generator: Quart closes the body when it is done
    with it, and closing releases the upstream response and ``cleanup`` even when iteration
    never started (a generator's own ``finally`` would not run then).
    """

    def __init__(self, resp: aiohttp.ClientResponse, first: bytes, request_id: str,
                 cleanup: contextlib.AsyncExitStack) -> None:
        self._resp, self._first, self._request_id = resp, first, request_id
        self._cleanup = cleanup
        self._chunks = resp.content.iter_any()
        self._closed = False

    def __aiter__(self) -> DecodeStream:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        if self._first:
            first, self._first = self._first, b""
            return first
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            await self.aclose()
            raise
        except UPSTREAM_ERRORS as exc:
            logger.warning("[%s] decode stream broke after it started: %s: %s",
                           self._request_id, type(exc).__name__, exc)
            await self.aclose()
            return sse_error_event(f"decode instance failed mid-stream: {type(exc).__name__}")

    async def aclose(self) -> None:
        """Close the upstream (an unfinished one sees the abort), then run ``cleanup``."""
        if self._closed:
            return
        self._closed = True
        self._resp.close()
        await self._cleanup.aclose()


# --------------------------------------------------------------------------- several prompts
# One set of kv_transfer_params cannot serve several prompts: D applies it to every sub-request
# and the second one fails in vLLM (PRs #50559, #54707). So a completions request with several
# prompts becomes one P/D flow per prompt, and the answers are merged back into one, as a
# single vLLM server would have answered: choice index = prompt index * n + choice index.


def split_prompts(req: ClientRequest) -> list[ClientRequest]:
    """One request per prompt, each with its own request id."""
    return [dataclasses.replace(req, body={**req.body, "prompt": prompt},
                                request_id=f"{req.request_id}-{i}")
            for i, prompt in enumerate(req.body["prompt"])]


def _reindex(choices: list[dict[str, Any]], prompt_index: int, n: int) -> None:
    for choice in choices:
        choice["index"] = prompt_index * n + int(choice.get("index") or 0)


def _add_usage(total: dict[str, int], usage: Any) -> None:
    if isinstance(usage, dict):
        for key, value in usage.items():
            if isinstance(value, int) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value


def merge_answers(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Non-streamed answers, one per prompt, as one answer."""
    merged = dict(answers[0])
    merged["choices"] = []
    usage: dict[str, int] = {}
    for i, answer in enumerate(answers):
        choices = [dict(c) for c in answer.get("choices") or []]
        _reindex(choices, i, n)
        merged["choices"].extend(choices)
        _add_usage(usage, answer.get("usage"))
    if "usage" in merged:
        merged["usage"] = usage
    if "kv_transfer_params" in merged:
        merged["kv_transfer_params"] = None
    return merged


async def serve_prompts(st: ProxyState, req: ClientRequest, flow: Flow) -> Response:
    """Run ``flow`` once per prompt, concurrently, and merge the answers.

    The first failure (before any byte went out) is the client's answer and the other flows
    are cancelled or closed.
    """
    subs = split_prompts(req)
    done: list[Response | None] = [None] * len(subs)

    async def one(i: int) -> None:
        done[i] = await flow(st, subs[i])

    try:
        async with asyncio.TaskGroup() as group:
            for i in range(len(subs)):
                group.create_task(one(i))
    except BaseException as exc:
        for resp in done:
            if resp is not None:
                await _close_body(resp)
        if isinstance(exc, BaseExceptionGroup):
            raise exc.exceptions[0] from None
        raise
    responses = [r for r in done if r is not None]
    n = int(req.body.get("n") or 1)
    headers = {"X-Request-Id": req.request_id}
    if req.stream:
        out = Response(MergedStream(responses, n), status=200,
                       content_type=responses[0].content_type, headers=headers)
        out.timeout = None
        return out
    answers = [json.loads(await r.get_data()) for r in responses]
    return Response(json.dumps(merge_answers(answers, n)), status=200,
                    content_type="application/json", headers=headers)


async def _close_body(resp: Response) -> None:
    body = resp.response
    await body.__aexit__(None, None, None)  # type: ignore[arg-type]


class MergedStream:
    """Several prompts' SSE streams as one: events interleaved as they arrive, choice indexes
    rewritten, usage chunks summed into one, a single ``data: [DONE]`` at the end."""

    def __init__(self, responses: list[Response], n: int) -> None:
        self._responses = responses
        self._n = n
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._usage: dict[str, int] = {}
        self._usage_event: dict[str, Any] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(responses)
        self._failed = False
        self._closed = False

    def __aiter__(self) -> MergedStream:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._pump(i, r))
                           for i, r in enumerate(self._responses)]
        while self._open:
            item = await self._queue.get()
            if item is None:
                self._open -= 1
            else:
                return item
        await self.aclose()
        return self._final()

    def _final(self) -> bytes:
        if self._failed:  # a sub-stream ended with an error event: no clean end
            return b""
        tail = b""
        if self._usage_event is not None:
            tail = _sse({**self._usage_event, "usage": self._usage})
        return tail + b"data: [DONE]\n\n"

    async def _pump(self, index: int, resp: Response) -> None:
        buffer = b""
        try:
            async with resp.response as body:
                async for chunk in body:
                    buffer += chunk
                    *events, buffer = buffer.split(b"\n\n")
                    for event in events:
                        out = self._rewrite(index, event)
                        if out:
                            await self._queue.put(out)
        finally:
            await self._queue.put(None)

    def _rewrite(self, index: int, event: bytes) -> bytes:
        data = event.removeprefix(b"data: ").strip()
        if data == b"[DONE]" or not data:
            return b""
        try:
            obj = json.loads(data)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict) or "error" in obj:
            self._failed = True
            return event + b"\n\n"
        choices = obj.get("choices") or []
        if not choices and obj.get("usage") is not None:
            _add_usage(self._usage, obj["usage"])
            self._usage_event = obj
            return b""
        _reindex(choices, index, self._n)
        return _sse(obj)

    async def aclose(self) -> None:
        """Stop every sub-stream (their own close releases their upstreams)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for resp in self._responses:
            await _close_body(resp)


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


# --------------------------------------------------------------------------- app


async def _client_request(route: str) -> ClientRequest:
    raw = await request.get_data(cache=False, as_text=False, parse_form_data=False)
    body = parse_body(raw)
    check_route_body(route, body)
    rid = request_id_from(request.headers.get("X-Request-Id"))
    return ClientRequest(route=route, body=body, request_id=rid,
                         authorization=request.headers.get("Authorization"))


def _completion_view(app: Quart, route: str, flow: Flow) -> Callable[[], Awaitable[Response]]:
    async def view() -> Response:
        st = state_of(app)
        st.metrics.in_flight.inc()
        try:
            resp = await _serve_completion(st, route, flow)
        finally:
            st.metrics.in_flight.dec()
        st.metrics.requests.labels(route, str(resp.status_code)).inc()
        return resp

    view.__name__ = f"{route.replace('/', '_')}_view"
    return view


async def _serve_completion(st: ProxyState, route: str, flow: Flow) -> Response:
    rid = "-"
    try:
        req = await _client_request(route)
        rid = req.request_id
        if route == "completions" and prompt_count(req.body) > 1:
            return await serve_prompts(st, req, flow)
        return await flow(st, req)
    except (ProxyError, UpstreamHTTPError, NoInstanceError, *UPSTREAM_ERRORS) as exc:
        err = map_error(exc, "upstream")
        logger.warning("[%s] %s -> %d: %s", rid, route, err.status, err)
        if err.leg != "proxy":
            st.metrics.leg_failures.labels(err.leg, str(err.status)).inc()
        return response_for(err)


def create_base_app(settings: Settings, flow: Flow, name: str) -> Quart:
    """The Quart app with the common routes and serving hooks; ``flow`` serves completions."""
    app = Quart(name)
    app.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES
    app.config["BODY_TIMEOUT"] = settings.read_timeout_s
    table = InstanceTable(ttl_s=settings.instance_ttl_s, policy=settings.policy)
    for url in settings.prefill_urls:
        table.add_static("P", url)
    for url in settings.decode_urls:
        table.add_static("D", url)
    app.extensions[EXTENSION_KEY] = ProxyState(settings=settings, table=table)
    for path, route in ROUTES.items():
        app.add_url_rule(path, view_func=_completion_view(app, route, flow), methods=["POST"])
    _add_info_routes(app)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _internal_error)
    app.while_serving(_lifespan(app))
    return app


async def _http_error(exc: HTTPException) -> Response:
    """Quart's own errors (unknown route, wrong method, body too large) in OpenAI's shape."""
    status = exc.code or 500
    name = (exc.name or "HTTP").title().replace(" ", "")
    return error_response(status, exc.description or exc.name or "error", f"{name}Error")


async def _internal_error(exc: Exception) -> Response:
    """A bug in the proxy: logged with its traceback; the client gets no internals."""
    logger.error("unhandled error: %s", exc, exc_info=exc)
    return error_response(500, "internal proxy error (logged)", "InternalServerError")


def _lifespan(app: Quart) -> Callable[[], AsyncGenerator[None, None]]:
    async def lifespan() -> AsyncGenerator[None, None]:
        st = state_of(app)
        listener = bind_discovery(st)
        connector = aiohttp.TCPConnector(limit=UPSTREAM_POOL_LIMIT, enable_cleanup_closed=True)
        st._session = aiohttp.ClientSession(connector=connector, timeout=st.timeout())
        task = None
        if listener is not None:
            task = asyncio.create_task(listener.run(), name="discovery-listener")
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await st._session.close()
            st._session = None
            st.listener = None

    return lifespan


def bind_discovery(st: ProxyState) -> registry.DiscoveryListener | None:
    """Bind the discovery ROUTER (once) when the settings ask for one; raises zmq.ZMQError."""
    s = st.settings
    if st.listener is None and s.discovery_port is not None:
        st.listener = registry.DiscoveryListener(st.table, s.discovery_host or "0.0.0.0",
                                                 s.discovery_port)
    return st.listener


def _add_info_routes(app: Quart) -> None:
    async def healthcheck() -> dict[str, Any]:
        t = state_of(app).table
        return {"status": "ok", "prefill_instances": t.count("P"),
                "decode_instances": t.count("D")}

    async def health() -> Response:
        t = state_of(app).table
        p, d = t.count("P"), t.count("D")
        ok = p > 0 and d > 0
        body = {"status": "ok" if ok else "unavailable", "prefill_instances": p,
                "decode_instances": d}
        return Response(json.dumps(body), status=200 if ok else 503,
                        content_type="application/json")

    async def instances() -> dict[str, Any]:
        st = state_of(app)
        return {"transfer_mode": st.table.transfer_mode, "instances": st.table.snapshot()}

    async def metrics() -> Response:
        data = prometheus_client.generate_latest(state_of(app).metrics.registry)
        return Response(data, content_type=prometheus_client.CONTENT_TYPE_LATEST)

    async def models() -> Response:
        return await _relay_models(state_of(app))

    for path, view in (("/healthcheck", healthcheck), ("/health", health),
                       ("/instances", instances), ("/metrics", metrics), ("/v1/models", models)):
        app.add_url_rule(path, view_func=view, methods=["GET"])
    for action in ("start_profile", "stop_profile"):
        app.add_url_rule(f"/{action}", view_func=_fan_out_view(app, action), methods=["POST"])


def _fan_out_view(app: Quart, action: str) -> Callable[[], Awaitable[Response]]:
    async def view() -> Response:
        return await fan_out(state_of(app), action)

    view.__name__ = f"{action}_view"
    return view


async def fan_out(st: ProxyState, action: str) -> Response:
    """POST /start_profile or /stop_profile to every routable instance (as vLLM's MoRIIO
    reference proxy does); 200 when all of them answered 2xx, else 502, with each answer."""
    targets = st.table.routable("P") + st.table.routable("D")

    async def one(inst: registry.Instance) -> dict[str, Any]:
        url = f"{inst.base_url.removesuffix('/v1')}/{action}"
        try:
            async with st.session.post(url, timeout=st.timeout(
                    st.settings.connect_timeout_s)) as r:
                return {"url": url, "role": inst.role, "status": r.status}
        except UPSTREAM_ERRORS as exc:
            return {"url": url, "role": inst.role, "status": None,
                    "error": f"{type(exc).__name__}: {exc}"}

    results = await asyncio.gather(*(one(i) for i in targets))
    ok = bool(results) and all(r["status"] is not None and r["status"] < 300 for r in results)
    return Response(json.dumps({"results": results}), status=200 if ok else 502,
                    content_type="application/json")


async def _relay_models(st: ProxyState) -> Response:
    try:
        inst = st.table.pick("D")
        async with st.session.get(f"{inst.base_url}/models", timeout=st.timeout(
                st.settings.connect_timeout_s)) as resp:
            body = await resp.read()
            ctype = resp.headers.get("Content-Type", "application/json")
        return Response(body, status=resp.status, content_type=ctype)
    except (NoInstanceError, *UPSTREAM_ERRORS) as exc:
        return response_for(map_error(exc, "decode"))


# --------------------------------------------------------------------------- serving


def hypercorn_config(settings: Settings, sock: socket.socket | None = None) -> HypercornConfig:
    """Explicit hypercorn settings: bind (or an already bound socket), backlog, keep-alive."""
    cfg = HypercornConfig()
    cfg.bind = [f"fd://{sock.detach()}"] if sock is not None else [_bind(settings)]
    cfg.backlog = LISTEN_BACKLOG
    cfg.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    cfg.graceful_timeout = GRACEFUL_TIMEOUT_S
    cfg.accesslog = None
    # Hypercorn's own errors go through the process's logging configuration, not a 2nd handler.
    cfg.errorlog = logging.getLogger("hypercorn.error")
    return cfg


def _bind(settings: Settings) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"{host}:{settings.port}"


async def serve(app: Quart, settings: Settings, shutdown: asyncio.Event | None = None,
                sock: socket.socket | None = None) -> None:
    """Serve ``app`` until SIGINT/SIGTERM (or ``shutdown`` is set), then drain gracefully."""
    stop = shutdown or asyncio.Event()
    loop = asyncio.get_running_loop()
    if shutdown is None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    # Bound before serving so that a taken discovery port is a plain error, not a lifespan one.
    listener = bind_discovery(state_of(app))
    try:
            await hypercorn_serve(app, hypercorn_config(settings, sock), shutdown_trigger=stop.wait)
    finally:
        if listener is not None:
            listener.close()


def run(app: Quart, settings: Settings) -> int:
    """Blocking entry for ``main()``; returns the process exit code."""
    try:
        # uvloop: the same asyncio API on libuv; the proxy is event-loop bound (BENCHMARKS.md).
        factory = uvloop.new_event_loop if settings.event_loop == "uvloop" else None
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(app, settings))
    except OSError as exc:
        logger.error("cannot serve on %s: %s", _bind(settings), exc)
        return 1
    except zmq.ZMQError as exc:
        logger.error("cannot listen for discovery: %s", exc)
        return 1
    return 0
