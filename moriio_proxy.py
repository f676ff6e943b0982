"""P/D proxy for AMD's MoRIIO KV connector (vLLM ``MoRIIOConnector``).

Instances announce themselves over ZMQ (``kv_connector_extra_config.proxy_ip`` and
``proxy_ping_port`` in vLLM; both MoRIIO dialects are accepted on one socket). Per request
(PROTOCOL.md section 3.2):

- a prefill (instance, data-parallel rank) slot is chosen so that every slot gets an equal
  share, and a decode instance (pinned to P's rank only when the DP sizes match);
- the request id ``___prefill_addr_<P zmq>___decode_addr_<D zmq>_<32 hex>`` (the connectors
  parse peers out of it) and a ``tx-<uuid>`` transfer id go to both legs;
- READ mode: P is awaited, then D gets P's engine id and block ids;
  WRITE mode: P and D are sent at once (P pushes KV into D); the P task is supervised, and its
  failure before D produced output is the client's answer;
- the client receives exactly the number of tokens it asked for (D samples its own first token;
  nothing is subtracted "for the prefill token").

Not here: static instances from flags (MoRIIO deployments announce), P2P NCCL's flow.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from quart import Quart, Response

import relay
from registry import Instance, InstanceTable
from relay import ClientRequest, ProxyState, Settings

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_HOST: Final = "0.0.0.0"  # the reference proxy's default, kept
DEFAULT_PORT: Final = 10001
DEFAULT_DISCOVERY_HOST: Final = "0.0.0.0"
DEFAULT_DISCOVERY_PORT: Final = 36367
#: Used until an instance announces its mode (announcements without one are P2P-style).
DEFAULT_TRANSFER_MODE: Final = "READ"
DP_RANK_HEADER: Final = "X-data-parallel-rank"
#: Fields of P's answer that D needs in READ mode.
READ_MODE_FIELDS: Final = ("remote_engine_id", "remote_block_ids", "transfer_id", "tp_size")


# --------------------------------------------------------------------------- settings


def build_parser() -> argparse.ArgumentParser:
    """The command line (the reference MoRIIO proxy's ports, plus our own flags)."""
    parser = argparse.ArgumentParser(
        prog="moriio_proxy.py", description="P/D proxy for vLLM's MoRIIO connector")
    relay.add_common_args(parser, host=DEFAULT_HOST, port=DEFAULT_PORT)
    parser.add_argument("--discovery-host", default=DEFAULT_DISCOVERY_HOST,
                        help=f"ZMQ ROUTER bind address (default {DEFAULT_DISCOVERY_HOST})")
    parser.add_argument("--discovery-port", type=relay.port_number,
                        default=DEFAULT_DISCOVERY_PORT,
                        help=f"ZMQ ROUTER port instances announce to "
                             f"(default {DEFAULT_DISCOVERY_PORT})")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """Command line -> Settings; exits with a usage error on bad flags."""
    ns = build_parser().parse_args(argv)
    return relay.common_settings(ns, discovery_host=ns.discovery_host,
                                 discovery_port=ns.discovery_port)


# --------------------------------------------------------------------------- builders


@dataclass(frozen=True)
class PeerAddress:
    """The KV side-channel of an instance, from its announced ``zmq_address``."""

    host: str
    handshake_port: int | None = None
    notify_port: int | None = None


def parse_zmq_address(zmq_address: str, fallback_host: str) -> PeerAddress:
    """``host:10.0.0.5,handshake:6301,notify:61005`` -> PeerAddress (fields may be missing)."""
    parts = dict(p.split(":", 1) for p in zmq_address.split(",") if ":" in p)

    def port(name: str) -> int | None:
        value = parts.get(name, "")
        return int(value) if value.isdigit() else None

    return PeerAddress(parts.get("host") or fallback_host, port("handshake"), port("notify"))


@dataclass(frozen=True)
class Plan:
    """Who serves one request, and the ids both legs share."""

    prefill: Instance
    prefill_rank: int | None  # None when P has no data parallelism
    decode: Instance
    decode_rank: int | None
    request_id: str
    transfer_id: str

    @property
    def p_peer(self) -> PeerAddress:
        """P's side channel."""
        return parse_zmq_address(self.prefill.zmq_address, _host(self.prefill))

    @property
    def d_peer(self) -> PeerAddress:
        """D's side channel."""
        return parse_zmq_address(self.decode.zmq_address, _host(self.decode))


def _host(inst: Instance) -> str:
    return inst.host_port.rsplit(":", 1)[0].strip("[]")


def make_request_id(prefill: Instance, decode: Instance, hex32: str | None = None) -> str:
    """The id MoRIIO connectors parse their peers out of (format is load-bearing)."""
    return (f"___prefill_addr_{prefill.zmq_address}___decode_addr_{decode.zmq_address}_"
            f"{hex32 or uuid.uuid4().hex}")


def plan_request(table: InstanceTable) -> Plan:
    """Pick P's slot and D, and D's rank: P's when the DP sizes match, else D's own rotation."""
    p, p_rank = table.pick_slot("P")
    d = table.pick("D")
    d_rank = p_rank if d.dp_size == p.dp_size else table.next_rank(d)
    return Plan(prefill=p, prefill_rank=p_rank if p.dp_size > 1 else None, decode=d,
                decode_rank=d_rank if d.dp_size > 1 else None,
                request_id=make_request_id(p, d), transfer_id=f"tx-{uuid.uuid4()}")


def build_prefill_body(body: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
    """P's body: one token, not streamed, with D's sizes and side channel."""
    d_peer = plan.d_peer
    ktp: dict[str, Any] = {
        "do_remote_decode": True, "do_remote_prefill": False,
        "remote_engine_id": None, "remote_block_ids": None,
        "remote_dp_size": plan.decode.dp_size, "remote_tp_size": plan.decode.tp_size,
        "transfer_id": plan.transfer_id, "remote_host": d_peer.host,
    }
    # WRITE mode pushes to D; without these the connector parses them from the request id.
    if d_peer.handshake_port is not None:
        ktp["remote_handshake_port"] = d_peer.handshake_port
    if d_peer.notify_port is not None:
        ktp["remote_notify_port"] = d_peer.notify_port
    return relay.prefill_body(body, ktp)


def build_decode_body(body: Mapping[str, Any], plan: Plan,
                      prefill_params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """D's body: the client's own (its token budget untouched), with P's side channel.

    ``prefill_params`` are P's answer in READ mode; their engine id, block ids, transfer id and
    TP size are copied over.
    """
    p_peer = plan.p_peer
    ktp: dict[str, Any] = {
        "do_remote_decode": False, "do_remote_prefill": True,
        "remote_engine_id": None, "remote_block_ids": None,
        "transfer_id": plan.transfer_id, "remote_host": p_peer.host,
        "remote_handshake_port": p_peer.handshake_port,
        "remote_notify_port": p_peer.notify_port,
        "remote_dp_size": plan.prefill.dp_size, "remote_tp_size": plan.prefill.tp_size,
        # D's connector reads tp_size as the peer's TP size (older proxies left it out).
        "tp_size": plan.prefill.tp_size,
    }
    if plan.prefill_rank is not None:
        ktp["remote_dp_rank"] = plan.prefill_rank
    for name in READ_MODE_FIELDS:
        if prefill_params and prefill_params.get(name) is not None:
            ktp[name] = prefill_params[name]
    return relay.decode_body(body, ktp)


def rank_header(rank: int | None) -> dict[str, str]:
    """The DP pinning header, only for instances with data parallelism."""
    return {} if rank is None else {DP_RANK_HEADER: str(rank)}


# --------------------------------------------------------------------------- flow


async def _leased(table: InstanceTable, inst: Instance, work: Awaitable[T]) -> T:
    with table.lease(inst):
        return await work


async def moriio_flow(st: ProxyState, req: ClientRequest) -> Response:
    """READ: P awaited, then D. WRITE: P and D at once, P supervised."""
    plan = plan_request(st.table)
    logger.debug("[%s] is %s; prefill %s rank %s, decode %s rank %s", req.request_id,
                 plan.request_id, plan.prefill.base_url, plan.prefill_rank,
                 plan.decode.base_url, plan.decode_rank)
    req = dataclasses.replace(req, request_id=plan.request_id)
    key = st.settings.api_key
    p_url = f"{plan.prefill.base_url}/{req.route}"
    d_url = f"{plan.decode.base_url}/{req.route}"
    p_call = relay.call_prefill(st, p_url, build_prefill_body(req.body, plan),
                                relay.upstream_headers(req, key, rank_header(plan.prefill_rank)))
    d_headers = relay.upstream_headers(req, key, rank_header(plan.decode_rank))
    cleanup = contextlib.AsyncExitStack()
    if (st.table.transfer_mode or DEFAULT_TRANSFER_MODE) == "WRITE":
        guard = relay.Supervised(st, "prefill", req.request_id,
                                 _leased(st.table, plan.prefill, p_call))
        cleanup.push_async_callback(guard.finish)
        cleanup.enter_context(st.table.lease(plan.decode))
        return await relay.decode_leg(st, req, d_url, build_decode_body(req.body, plan),
                                      d_headers, cleanup=cleanup, guard=guard)
    answer = await _leased(st.table, plan.prefill, p_call)
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        logger.warning("[%s] prefill returned no kv_transfer_params; decode recomputes",
                       req.request_id)
        d_body = relay.decode_body(req.body, None)
    else:
        d_body = build_decode_body(req.body, plan, params)
    cleanup.enter_context(st.table.lease(plan.decode))
    return await relay.decode_leg(st, req, d_url, d_body, d_headers, cleanup=cleanup)


def create_app(settings: Settings) -> Quart:
    """The MoRIIO proxy app (nothing runs until it is served)."""
    return relay.create_base_app(settings, moriio_flow, __name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python moriio_proxy.py --port 10001``."""
    settings = parse_args(argv)
    relay.configure_logging(settings.log_level)
    logger.info("MoRIIO proxy on %s:%d; discovery on %s:%d", settings.host, settings.port,
                settings.discovery_host, settings.discovery_port)
    return relay.run(create_app(settings), settings)


if __name__ == "__main__":
    sys.exit(main())
