"""Who is out there: vLLM prefill (P) and decode (D) instances, and how to pick one.

This module holds
- the wire format of the discovery announcements that vLLM instances send (three dialects:
  MoRIIO current, MoRIIO old, P2P NCCL; see PROTOCOL.md section 1), parsed and validated into
  :class:`Announcement` records;
- the :class:`InstanceTable`: static instances (from CLI flags, never expire) and announced ones
  (refreshed by every message, dropped after ``ttl_s`` of silence), with per-role selection
  (round robin or least in-flight) and the MoRIIO transfer-mode rule;
- :class:`DiscoveryListener`: an asyncio ZMQ ROUTER that feeds the table and never stops on bad
  input;
- :class:`Announcer`: the DEALER side, used by fake instances, ``scripts/announce.py`` and tests.

The relay only talks to the table through ``pick``/``pick_slot``/``lease``/``snapshot``, so a
table shared between worker processes can replace it later.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

#: Announcements are a few hundred bytes; anything far larger is garbage or an attack.
MAX_ANNOUNCEMENT_BYTES: Final = 64 * 1024
#: Upper bound accepted for dp_size/tp_size (a sanity check against corrupt values).
MAX_PARALLEL_SIZE: Final = 4096
#: Default silence after which an announced instance leaves the rotation (vLLM pings every 3 s).
DEFAULT_INSTANCE_TTL_S: Final = 15.0
#: How often the listener sweeps expired instances out of the table.
SWEEP_INTERVAL_S: Final = 1.0
#: vLLM's MoRIIO connector re-announces every 3 s.
DEFAULT_ANNOUNCE_INTERVAL_S: Final = 3.0

ROLES: Final = ("P", "D")
TRANSFER_MODES: Final = ("READ", "WRITE")


class Policy(enum.StrEnum):
    """How an instance of a role is chosen."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"


class Dialect(enum.StrEnum):
    """The three announcement dialects seen in the field (PROTOCOL.md section 1)."""

    MORIIO = "moriio"
    MORIIO_OLD = "moriio_old"
    P2P_NCCL = "p2p_nccl"


class AnnouncementError(ValueError):
    """An announcement that cannot be accepted; the message says why."""


@dataclass(frozen=True)
class Announcement:
    """One validated discovery message, whatever its dialect."""

    role: str
    base_url: str
    dialect: Dialect
    zmq_address: str = ""
    dp_size: int = 1
    tp_size: int = 1
    transfer_mode: str | None = None


@dataclass(frozen=True)
class Instance:
    """A vLLM OpenAI server. Identity is ``base_url`` (``http://host:port/v1``)."""

    role: str
    base_url: str
    zmq_address: str = ""
    dp_size: int = 1
    tp_size: int = 1
    transfer_mode: str | None = None
    static: bool = False

    @property
    def host_port(self) -> str:
        """``host:port`` of the HTTP server."""
        return self.base_url.split("://", 1)[-1].split("/", 1)[0]


@dataclass
class _Entry:
    instance: Instance
    last_seen: float
    refused: str | None = None
    in_flight: int = 0
    served: int = 0


class NoInstanceError(LookupError):
    """No routable instance of the requested role."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no {'prefill' if role == 'P' else 'decode'} instance is available")
        self.role = role


# --------------------------------------------------------------------------- wire format


def _field(msg: Mapping[Any, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in msg:
        raise AnnouncementError(f"missing field {name!r}")
    value = msg[name]
    # bool is an int subclass; a size of True is a type error, not 1.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise AnnouncementError(f"field {name!r} has type {type(value).__name__}")
    return value


def _size(msg: Mapping[Any, Any], name: str) -> int:
    if name not in msg:
        return 1
    value: int = _field(msg, name, int)
    if not 1 <= value <= MAX_PARALLEL_SIZE:
        raise AnnouncementError(f"field {name!r} out of range: {value}")
    return value


def _port(msg: Mapping[Any, Any], name: str) -> int:
    value: int = _field(msg, name, int)
    if not 0 < value < 65536:
        raise AnnouncementError(f"field {name!r} is not a port: {value}")
    return value


def _role(value: Any) -> str:
    if value not in ROLES:
        raise AnnouncementError(f"unknown role {value!r}")
    return str(value)


def _transfer_mode(msg: Mapping[Any, Any]) -> str | None:
    if "transfer_mode" not in msg:
        return None
    mode = str(_field(msg, "transfer_mode", str)).upper()
    if mode not in TRANSFER_MODES:
        raise AnnouncementError(f"unknown transfer_mode {mode!r}")
    return mode


def _host_port(text: str, name: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AnnouncementError(f"field {name!r} is not host:port: {text!r}")
    return host, int(port)


def base_url_from_http_address(address: str) -> str:
    """``10.0.0.5:8100`` -> ``http://10.0.0.5:8100/v1`` (current dialects carry no scheme)."""
    address = address.strip()
    if "://" in address:
        address = address.split("://", 1)[1]
    address = address.split("/", 1)[0]
    _host_port(address, "http_address")
    return f"http://{address}/v1"


def base_url_from_request_address(address: str) -> str:
    """Old MoRIIO ``request_address``: keep everything up to and including ``/v1``.

    It ends in ``/v1/completions`` (old connector) or ``/v1`` (after vLLM PR #39565); the proxy
    appends the route itself, so chat never lands on ``/completions``.
    """
    if not address.startswith(("http://", "https://")):
        raise AnnouncementError(f"request_address has no http scheme: {address!r}")
    head, sep, _ = address.partition("/v1")
    if not sep:
        raise AnnouncementError(f"request_address has no /v1: {address!r}")
    _host_port(head.split("://", 1)[1], "request_address")
    return head + "/v1"


def parse_announcement(msg: object) -> Announcement | None:
    """Validate a decoded message. Returns None for HELLO; raises AnnouncementError otherwise."""
    if not isinstance(msg, Mapping):
        raise AnnouncementError(f"message is a {type(msg).__name__}, not a map")
    kind = msg.get("type")
    if kind == "HELLO":
        return None
    if kind == "register":
        return _parse_moriio_old(msg)
    if kind in ROLES:
        return _parse_current(msg)
    raise AnnouncementError(f"unknown message type {kind!r}")


def _parse_current(msg: Mapping[Any, Any]) -> Announcement:
    base_url = base_url_from_http_address(_field(msg, "http_address", str))
    zmq_address = str(_field(msg, "zmq_address", str)) if "zmq_address" in msg else ""
    has_sizes = any(k in msg for k in ("dp_size", "tp_size", "transfer_mode"))
    return Announcement(
        role=_role(msg["type"]),
        base_url=base_url,
        dialect=Dialect.MORIIO if has_sizes else Dialect.P2P_NCCL,
        zmq_address=zmq_address,
        dp_size=_size(msg, "dp_size"),
        tp_size=_size(msg, "tp_size"),
        transfer_mode=_transfer_mode(msg),
    )


def _parse_moriio_old(msg: Mapping[Any, Any]) -> Announcement:
    base_url = base_url_from_request_address(_field(msg, "request_address", str))
    host = Instance("P", base_url).host_port.rsplit(":", 1)[0]
    handshake = _port(msg, "handshake_port")
    notify = _port(msg, "notify_port")
    # Old instances carry no zmq_address; build the current one so the request id is uniform.
    return Announcement(
        role=_role(msg.get("role")),
        base_url=base_url,
        dialect=Dialect.MORIIO_OLD,
        zmq_address=f"host:{host},handshake:{handshake},notify:{notify}",
        dp_size=_size(msg, "dp_size"),
        tp_size=_size(msg, "tp_size"),
        transfer_mode=_transfer_mode(msg),
    )


def decode_frames(frames: list[bytes]) -> Announcement | None:
    """ROUTER frames ``[identity, payload]`` -> announcement (None for HELLO)."""
    if len(frames) != 2:
        raise AnnouncementError(f"expected 1 payload frame, got {len(frames) - 1}")
    payload = frames[1]
    if len(payload) > MAX_ANNOUNCEMENT_BYTES:
        raise AnnouncementError(f"payload of {len(payload)} bytes is too large")
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise AnnouncementError(f"payload is not msgpack ({type(exc).__name__})") from None
    return parse_announcement(msg)


def encode_announcement(ann: Announcement, *, counter: int = 0) -> bytes:
    """The payload a vLLM instance of ``ann.dialect`` would send."""
    host_port = Instance(ann.role, ann.base_url).host_port
    msg: dict[str, Any]
    if ann.dialect is Dialect.MORIIO_OLD:
        parts = dict(p.split(":", 1) for p in ann.zmq_address.split(",") if ":" in p)
        msg = {
            "type": "register", "role": ann.role, "index": str(counter),
            "request_address": ann.base_url, "handshake_port": int(parts["handshake"]),
            "notify_port": int(parts["notify"]), "dp_size": ann.dp_size, "tp_size": ann.tp_size,
        }
    else:
        msg = {"type": ann.role, "http_address": host_port, "zmq_address": ann.zmq_address}
        if ann.dialect is Dialect.MORIIO:
            msg.update(dp_size=ann.dp_size, tp_size=ann.tp_size)
    if ann.transfer_mode is not None and ann.dialect is not Dialect.P2P_NCCL:
        msg["transfer_mode"] = ann.transfer_mode
    packed: bytes = msgpack.packb(msg, use_bin_type=True)
    return packed


# --------------------------------------------------------------------------- instance table


@dataclass
class InstanceTable:
    """Prefill and decode instances, their liveness, and selection.

    One event loop owns it; nothing here awaits, so no locks are needed.
    """

    ttl_s: float = DEFAULT_INSTANCE_TTL_S
    policy: Policy = Policy.ROUND_ROBIN
    clock: Any = time.monotonic
    transfer_mode: str | None = None
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _counters: dict[str, itertools.count[int]] = field(default_factory=dict)

    def add_static(self, role: str, base_url: str) -> None:
        """An instance from the command line: never expires."""
        inst = Instance(role=_role(role), base_url=base_url.rstrip("/"), static=True)
        self._entries[inst.base_url] = _Entry(inst, self.clock())

    def observe(self, ann: Announcement) -> bool:
        """Register or refresh an announced instance. Returns False when it is refused."""
        now = self.clock()
        entry = self._entries.get(ann.base_url)
        inst = Instance(
            role=ann.role, base_url=ann.base_url, zmq_address=ann.zmq_address,
            dp_size=ann.dp_size, tp_size=ann.tp_size, transfer_mode=ann.transfer_mode,
        )
        refused = self._refusal(ann)
        if entry is None:
            self._entries[ann.base_url] = _Entry(inst, now, refused)
            self._log_new(inst, refused)
        else:
            if entry.instance.static:
                return True
            if entry.instance != inst or entry.refused != refused:
                logger.info("instance %s changed: %s", ann.base_url, inst)
            entry.instance, entry.last_seen, entry.refused = inst, now, refused
        return refused is None

    def _refusal(self, ann: Announcement) -> str | None:
        if ann.transfer_mode is None:
            return None
        if self.transfer_mode is None:
            self.transfer_mode = ann.transfer_mode
            logger.info("transfer mode fixed to %s by %s", ann.transfer_mode, ann.base_url)
            return None
        if ann.transfer_mode != self.transfer_mode:
            return (f"transfer_mode {ann.transfer_mode} differs from the deployment's "
                    f"{self.transfer_mode}")
        return None

    @staticmethod
    def _log_new(inst: Instance, refused: str | None) -> None:
        if refused:
            logger.error("refusing instance %s (%s): %s", inst.base_url, inst.role, refused)
        else:
            logger.info("registered %s instance %s (zmq %s, dp %d, tp %d)", inst.role,
                        inst.base_url, inst.zmq_address or "-", inst.dp_size, inst.tp_size)

    def sweep(self) -> list[Instance]:
        """Drop announced instances silent for longer than the TTL; returns the dropped ones."""
        deadline = self.clock() - self.ttl_s
        gone = [e for e in self._entries.values()
                if not e.instance.static and e.last_seen < deadline]
        for entry in gone:
            del self._entries[entry.instance.base_url]
            logger.warning("instance %s (%s) expired after %.1f s of silence",
                           entry.instance.base_url, entry.instance.role, self.ttl_s)
        return [e.instance for e in gone]

    def _routable(self, role: str) -> list[_Entry]:
        deadline = self.clock() - self.ttl_s
        return [e for e in self._entries.values()
                if e.instance.role == role and e.refused is None
                and (e.instance.static or e.last_seen >= deadline)]

    def routable(self, role: str) -> list[Instance]:
        """Instances of ``role`` that may receive traffic now, in a stable order."""
        return [e.instance for e in self._sorted(role)]

    def _sorted(self, role: str) -> list[_Entry]:
        return sorted(self._routable(role), key=lambda e: e.instance.base_url)

    def _next(self, key: str) -> int:
        return next(self._counters.setdefault(key, itertools.count()))

    def pick(self, role: str) -> Instance:
        """One instance of ``role`` per the policy; raises NoInstanceError."""
        entries = self._sorted(role)
        if not entries:
            raise NoInstanceError(role)
        n = self._next(role)
        if self.policy is Policy.LEAST_LOADED:
            # Rotate before taking the minimum so ties are spread evenly.
            k = n % len(entries)
            rotated = entries[k:] + entries[:k]
            return min(rotated, key=lambda e: e.in_flight).instance
        return entries[n % len(entries)].instance

    def pick_slot(self, role: str) -> tuple[Instance, int]:
        """An (instance, dp_rank) pair so that every slot gets an equal share of traffic.

        Slots are interleaved (slot = n mod total; instance = slot mod instances; rank = slot //
        instances), which avoids the aliasing of ``n % dp_size`` in the reference proxy. With
        unequal dp sizes the flat slot list is walked instead. least_loaded picks the least busy
        instance, then walks that instance's own ranks.
        """
        entries = self._sorted(role)
        if not entries:
            raise NoInstanceError(role)
        if self.policy is Policy.LEAST_LOADED:
            inst = self.pick(role)
            return inst, self.next_rank(inst)
        slots = [(e.instance, r) for r in range(max(e.instance.dp_size for e in entries))
                 for e in entries if r < e.instance.dp_size]
        return slots[self._next(f"{role}#slots") % len(slots)]

    def next_rank(self, inst: Instance) -> int:
        """The next data-parallel rank of ``inst`` in its own rotation."""
        return self._next(f"{inst.role}@{inst.base_url}") % inst.dp_size

    @contextlib.contextmanager
    def lease(self, inst: Instance) -> Iterator[None]:
        """Count a request in flight on ``inst`` for the least-loaded policy."""
        entry = self._entries.get(inst.base_url)
        if entry is not None:
            entry.in_flight += 1
            entry.served += 1
        try:
            yield
        finally:
            if entry is not None:
                entry.in_flight -= 1

    def count(self, role: str) -> int:
        """How many routable instances of ``role`` there are."""
        return len(self._routable(role))

    def snapshot(self) -> list[dict[str, Any]]:
        """Every known instance as plain data (for the instance listing)."""
        now = self.clock()
        return [{
            "role": e.instance.role, "url": e.instance.base_url,
            "zmq_address": e.instance.zmq_address, "dp_size": e.instance.dp_size,
            "tp_size": e.instance.tp_size, "transfer_mode": e.instance.transfer_mode,
            "static": e.instance.static,
            "state": "refused" if e.refused else "active", "refused_reason": e.refused,
            "last_seen_s_ago": round(now - e.last_seen, 3),
            "in_flight": e.in_flight, "served": e.served,
        } for e in sorted(self._entries.values(), key=lambda e: e.instance.base_url)]


# --------------------------------------------------------------------------- ZMQ sides


class DiscoveryListener:
    """The ROUTER socket vLLM instances announce themselves to. Runs in the event loop."""

    def __init__(self, table: InstanceTable, host: str, port: int,
                 ctx: zmq.asyncio.Context | None = None) -> None:
        self.table = table
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # libzmq refuses a frame larger than this outright, before it is buffered.
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANNOUNCEMENT_BYTES)
        self._sock.bind(f"tcp://{_zmq_host(host)}:{port}")
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self.received = 0
        self.rejected = 0

    async def run(self) -> None:
        """Receive until cancelled; sweeps expired instances between messages."""
        logger.info("discovery listening on %s", self.endpoint)
        try:
            while True:
                if await self._sock.poll(SWEEP_INTERVAL_S * 1000):
                    self.handle(await self._sock.recv_multipart())
                self.table.sweep()
        finally:
            self._sock.close(linger=0)

    def handle(self, frames: list[bytes]) -> None:
        """Apply one ROUTER message to the table; bad input is logged once and dropped."""
        self.received += 1
        sender = frames[0].hex() if frames else "?"
        try:
            ann = decode_frames(frames)
        except AnnouncementError as exc:
            self.rejected += 1
            logger.warning("dropped announcement from peer %s: %s", sender, exc)
            return
        if ann is not None:
            self.table.observe(ann)

    def close(self) -> None:
        """Close the socket (when ``run`` was never started)."""
        self._sock.close(linger=0)


def _zmq_host(host: str) -> str:
    return "*" if host in ("", "0.0.0.0") else host


class Announcer:
    """A DEALER that announces one instance every ``interval_s`` seconds, like vLLM does."""

    def __init__(self, ann: Announcement, target: str, interval_s: float =
                 DEFAULT_ANNOUNCE_INTERVAL_S, ctx: zmq.asyncio.Context | None = None) -> None:
        self.ann = ann
        self.target = target if target.startswith("tcp://") else f"tcp://{target}"
        self.interval_s = interval_s
        self.sent = 0
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        # Give a queued announcement a moment to leave before close (pyzmq drops it at linger 0).
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.connect(self.target)

    async def send_once(self) -> None:
        """Send one announcement (a registration and a heartbeat at once)."""
        await self._sock.send(encode_announcement(self.ann, counter=self.sent))
        self.sent += 1

    async def send_raw(self, *frames: bytes) -> None:
        """Send arbitrary frames (tests use it to send garbage)."""
        await self._sock.send_multipart(list(frames))

    async def run(self) -> None:
        """Announce until cancelled."""
        try:
            while True:
                await self.send_once()
                await asyncio.sleep(self.interval_s)
        finally:
            self.close()

    def close(self) -> None:
        """Close the DEALER socket."""
        self._sock.close()
