"""registry.py: announcement dialects, bad messages, the instance table, the ZMQ listener."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

import registry
from conftest import wait_for
from registry import Announcement, AnnouncementError, Dialect, InstanceTable, Policy


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


MORIIO = {"type": "P", "http_address": "10.0.0.5:8100",
          "zmq_address": "host:10.0.0.5,handshake:6301,notify:61005",
          "dp_size": 2, "tp_size": 8, "transfer_mode": "READ"}
MORIIO_OLD = {"type": "register", "role": "D", "index": "7",
              "request_address": "http://10.0.0.6:8200/v1/completions",
              "handshake_port": 6301, "notify_port": 61005, "dp_size": 1, "tp_size": 1,
              "transfer_mode": "WRITE"}
NCCL = {"type": "D", "http_address": "10.0.0.7:8300", "zmq_address": "10.0.0.7:21001"}


# --------------------------------------------------------------------------- wire format


def test_moriio_current_dialect() -> None:
    ann = registry.parse_announcement(MORIIO)
    assert ann == Announcement(role="P", base_url="http://10.0.0.5:8100/v1",
                               dialect=Dialect.MORIIO,
                               zmq_address="host:10.0.0.5,handshake:6301,notify:61005",
                               dp_size=2, tp_size=8, transfer_mode="READ")


@pytest.mark.parametrize("address", ["http://10.0.0.6:8200/v1/completions",
                                     "http://10.0.0.6:8200/v1"])
def test_moriio_old_dialect_base_url_keeps_v1(address: str) -> None:
    ann = registry.parse_announcement({**MORIIO_OLD, "request_address": address})
    assert ann is not None
    assert ann.base_url == "http://10.0.0.6:8200/v1"
    assert ann.role == "D" and ann.dialect is Dialect.MORIIO_OLD
    assert ann.zmq_address == "host:10.0.0.6,handshake:6301,notify:61005"
    assert ann.transfer_mode == "WRITE"


def test_old_dialect_index_is_not_identity() -> None:
    a = registry.parse_announcement({**MORIIO_OLD, "index": "1"})
    b = registry.parse_announcement({**MORIIO_OLD, "index": "2"})
    assert a == b


def test_p2p_nccl_dialect() -> None:
    ann = registry.parse_announcement(NCCL)
    assert ann == Announcement(role="D", base_url="http://10.0.0.7:8300/v1",
                               dialect=Dialect.P2P_NCCL, zmq_address="10.0.0.7:21001")


def test_hello_is_ignored() -> None:
    assert registry.parse_announcement({"type": "HELLO"}) is None


@pytest.mark.parametrize("ann", [
    Announcement("P", "http://127.0.0.1:9000/v1", Dialect.MORIIO,
                 "host:127.0.0.1,handshake:1,notify:2", 4, 2, "WRITE"),
    Announcement("D", "http://127.0.0.1:9000/v1", Dialect.MORIIO_OLD,
                 "host:127.0.0.1,handshake:11,notify:12", 1, 1, "READ"),
    Announcement("D", "http://127.0.0.1:9000/v1", Dialect.P2P_NCCL, "127.0.0.1:5000"),
])
def test_encode_then_decode_round_trips(ann: Announcement) -> None:
    assert registry.decode_frames([b"id", registry.encode_announcement(ann)]) == ann


@pytest.mark.parametrize(("msg", "problem"), [
    ([1, 2], "not a map"),
    ("P", "not a map"),
    ({"type": "X"}, "unknown message type"),
    ({**MORIIO, "type": "Q"}, "unknown message type"),
    ({k: v for k, v in MORIIO.items() if k != "http_address"}, "missing field 'http_address'"),
    ({**MORIIO, "http_address": 5}, "has type int"),
    ({**MORIIO, "http_address": "nohostport"}, "not host:port"),
    ({**MORIIO, "dp_size": -1}, "out of range"),
    ({**MORIIO, "dp_size": 0}, "out of range"),
    ({**MORIIO, "tp_size": True}, "has type bool"),
    ({**MORIIO, "tp_size": "8"}, "has type str"),
    ({**MORIIO, "dp_size": 10**9}, "out of range"),
    ({**MORIIO, "transfer_mode": "PUSH"}, "unknown transfer_mode"),
    ({**MORIIO, "zmq_address": None}, "has type NoneType"),
    ({**MORIIO_OLD, "role": "X"}, "unknown role"),
    ({**MORIIO_OLD, "request_address": "10.0.0.6:8200/v1"}, "no http scheme"),
    ({**MORIIO_OLD, "request_address": "http://10.0.0.6:8200/api"}, "no /v1"),
    ({**MORIIO_OLD, "handshake_port": 70000}, "not a port"),
    ({k: v for k, v in MORIIO_OLD.items() if k != "notify_port"}, "missing field"),
])
def test_bad_messages_are_refused_with_a_reason(msg: Any, problem: str) -> None:
    with pytest.raises(AnnouncementError, match=problem):
        registry.decode_frames([b"id", pack(msg)])


def test_bad_frames() -> None:
    with pytest.raises(AnnouncementError, match="not msgpack"):
        registry.decode_frames([b"id", b"\xc1\xc1garbage"])
    with pytest.raises(AnnouncementError, match="expected 1 payload frame, got 2"):
        registry.decode_frames([b"id", pack(NCCL), pack(NCCL)])
    with pytest.raises(AnnouncementError, match="too large"):
        registry.decode_frames([b"id", b"\x00" * (registry.MAX_ANNOUNCEMENT_BYTES + 1)])


# --------------------------------------------------------------------------- table


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ann(port: int, role: str = "P", mode: str | None = None, dp: int = 1) -> Announcement:
    return Announcement(role, f"http://127.0.0.1:{port}/v1", Dialect.MORIIO,
                        f"host:127.0.0.1,handshake:{port + 1},notify:{port + 2}", dp, 1, mode)


def test_announced_instance_expires_after_ttl_and_returns() -> None:
    clock = Clock()
    table = InstanceTable(ttl_s=15, clock=clock)
    table.observe(ann(9000))
    clock.now += 14.9
    assert table.count("P") == 1
    clock.now += 0.2
    assert table.count("P") == 0, "a silent instance must leave the rotation at once"
    assert [i.base_url for i in table.sweep()] == ["http://127.0.0.1:9000/v1"]
    assert table.snapshot() == []
    table.observe(ann(9000))
    assert table.count("P") == 1


def test_heartbeat_refreshes_and_updates_fields() -> None:
    clock = Clock()
    table = InstanceTable(ttl_s=15, clock=clock)
    table.observe(ann(9000, dp=1))
    clock.now += 10
    table.observe(ann(9000, dp=4))
    clock.now += 10
    assert table.routable("P")[0].dp_size == 4


def test_static_instances_never_expire() -> None:
    clock = Clock()
    table = InstanceTable(ttl_s=1, clock=clock)
    table.add_static("D", "http://127.0.0.1:9/v1/")
    clock.now += 10**6
    assert table.sweep() == []
    assert table.routable("D")[0].base_url == "http://127.0.0.1:9/v1"


def test_round_robin_is_even_per_role() -> None:
    table = InstanceTable()
    for port in (9000, 9010, 9020):
        table.observe(ann(port))
    table.observe(ann(9500, role="D"))
    picks = Counter(table.pick("P").base_url for _ in range(300))
    assert set(picks.values()) == {100}
    assert table.pick("D").base_url == "http://127.0.0.1:9500/v1"


def test_no_instance_raises() -> None:
    with pytest.raises(registry.NoInstanceError, match="no decode instance"):
        InstanceTable().pick("D")


def test_least_loaded_prefers_idle_instances() -> None:
    table = InstanceTable(policy=Policy.LEAST_LOADED)
    table.observe(ann(9000))
    table.observe(ann(9010))
    busy = table.routable("P")[0]
    with table.lease(busy), table.lease(busy):
        assert {table.pick("P").base_url for _ in range(10)} == {"http://127.0.0.1:9010/v1"}
    # Ties are spread, not always the first.
    assert len({table.pick("P").base_url for _ in range(4)}) == 2
    assert [e["in_flight"] for e in table.snapshot()] == [0, 0]


def test_transfer_mode_fixed_by_first_and_other_mode_refused() -> None:
    table = InstanceTable()
    assert table.observe(ann(9000, mode="READ"))
    assert not table.observe(ann(9010, role="D", mode="WRITE"))
    assert table.count("D") == 0
    listed = {e["url"]: e for e in table.snapshot()}
    assert listed["http://127.0.0.1:9010/v1"]["state"] == "refused"
    assert "WRITE" in listed["http://127.0.0.1:9010/v1"]["refused_reason"]
    assert table.transfer_mode == "READ"


# --------------------------------------------------------------------------- ZMQ listener


@pytest.fixture
async def listener(zctx: zmq.asyncio.Context) -> AsyncIterator[registry.DiscoveryListener]:
    lst = registry.DiscoveryListener(InstanceTable(ttl_s=0.5), "127.0.0.1", 0, zctx)
    task = asyncio.create_task(lst.run())
    yield lst
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def dealer_send(ctx: zmq.asyncio.Context, endpoint: str, *frames: bytes) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    await sock.send_multipart(list(frames))
    sock.close(linger=1000)


@pytest.mark.parametrize("msg", [MORIIO, MORIIO_OLD, NCCL])
async def test_listener_accepts_every_dialect(listener: registry.DiscoveryListener,
                                              zctx: zmq.asyncio.Context, msg: Any) -> None:
    await dealer_send(zctx, listener.endpoint, pack(msg))
    await wait_for(lambda: len(listener.table.snapshot()) == 1, what="registration")


async def test_listener_survives_bad_input(listener: registry.DiscoveryListener,
                                           zctx: zmq.asyncio.Context,
                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="registry")
    await dealer_send(zctx, listener.endpoint, b"\xc1not msgpack")
    await dealer_send(zctx, listener.endpoint, pack([1, 2, 3]))
    await dealer_send(zctx, listener.endpoint, pack({**MORIIO, "dp_size": -3}))
    await dealer_send(zctx, listener.endpoint, pack(MORIIO), pack(MORIIO))
    await dealer_send(zctx, listener.endpoint, pack({"type": "HELLO"}))
    # A frame over MAXMSGSIZE makes libzmq drop that peer's connection; nothing else happens.
    await dealer_send(zctx, listener.endpoint, b"x" * (registry.MAX_ANNOUNCEMENT_BYTES + 10))
    await dealer_send(zctx, listener.endpoint, pack(NCCL))
    await wait_for(lambda: listener.table.count("D") == 1, what="the good message")
    assert listener.rejected == 4
    warnings = [r.getMessage() for r in caplog.records if "dropped announcement" in r.message]
    assert len(warnings) == 4
    assert all("from peer " in w for w in warnings)


async def test_listener_expires_silent_instances(listener: registry.DiscoveryListener,
                                                 zctx: zmq.asyncio.Context) -> None:
    await dealer_send(zctx, listener.endpoint, pack(NCCL))
    await wait_for(lambda: listener.table.count("D") == 1, what="registration")
    await wait_for(lambda: listener.table.snapshot() == [], timeout=5, what="expiry sweep")


async def test_announcer_heartbeats_keep_instance_alive(listener: registry.DiscoveryListener,
                                                        zctx: zmq.asyncio.Context) -> None:
    a = registry.Announcer(ann(9000, role="D"), listener.endpoint, interval_s=0.1, ctx=zctx)
    task = asyncio.create_task(a.run())
    try:
        await wait_for(lambda: a.sent >= 12, what="a second of heartbeats")
        assert listener.table.count("D") == 1, "0.5 s TTL outlived by 0.1 s heartbeats"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await wait_for(lambda: listener.table.count("D") == 0, timeout=5, what="expiry")
