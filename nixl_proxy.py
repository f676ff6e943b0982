"""P/D proxy for vLLM's NixlConnector (KV pulled by the decode instance).

Per request: P gets the client's body as a one-token, non-streaming prefill with
``kv_transfer_params.do_remote_decode``; P's returned ``kv_transfer_params`` go verbatim into
D's body (the client's own body otherwise); D's answer is relayed to the client as it arrives
(PROTOCOL.md section 3.1).

A drop-in for the command line of vLLM's
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``; instances may also announce
themselves over ZMQ (``--discovery-port``, or ``scripts/announce.py`` for NIXL instances, which
do not announce on their own).

Not here: retries on another instance, the P2P NCCL flow. (Completions with several prompts are
split into one flow per prompt by ``relay.serve_prompts``.)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final

from quart import Quart, Response

import relay
from relay import ClientRequest, ProxyState, Settings

logger = logging.getLogger(__name__)

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8000

#: What P must be told so that it keeps the KV for a remote decode (PROTOCOL.md 3.1 step 2).
PREFILL_KV_TRANSFER_PARAMS: Final[Mapping[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# --------------------------------------------------------------------------- settings


def build_parser() -> argparse.ArgumentParser:
    """The command line (the toy proxy's flags, plus discovery and our own)."""
    parser = argparse.ArgumentParser(
        prog="nixl_proxy.py", description="P/D proxy for vLLM's NixlConnector")
    relay.add_common_args(parser, host=DEFAULT_HOST, port=DEFAULT_PORT)
    for role, name in (("prefill", "prefiller"), ("decode", "decoder")):
        parser.add_argument(f"--{name}-hosts", f"--{name}-host", dest=f"{role}_hosts",
                            nargs="+", default=[], metavar="HOST",
                            help=f"{role} instance hosts")
        parser.add_argument(f"--{name}-ports", f"--{name}-port", dest=f"{role}_ports",
                            nargs="+", default=[], type=relay.port_number, metavar="PORT",
                            help=f"{role} instance ports, one per host")
    parser.add_argument("--discovery-host", default="127.0.0.1",
                        help="address of the ZMQ ROUTER for announced instances")
    parser.add_argument("--discovery-port", type=relay.port_number, default=None,
                        help="also accept announced instances on this port (off by default)")
    return parser


def _urls(parser: argparse.ArgumentParser, hosts: list[str], ports: list[int],
          name: str) -> tuple[str, ...]:
    if len(hosts) != len(ports):
        parser.error(f"--{name}-hosts has {len(hosts)} values but --{name}-ports has "
                     f"{len(ports)}: give one port per host")
    pairs = zip(hosts, ports, strict=True)
    return tuple(f"http://{f'[{h}]' if ':' in h else h}:{p}/v1" for h, p in pairs)


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """Command line -> Settings; exits with a usage error on bad flags."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    prefill = _urls(parser, ns.prefill_hosts, ns.prefill_ports, "prefiller")
    decode = _urls(parser, ns.decode_hosts, ns.decode_ports, "decoder")
    if ns.discovery_port is None and not (prefill and decode):
        parser.error("give at least one prefiller and one decoder (--prefiller-hosts/-ports, "
                     "--decoder-hosts/-ports), or --discovery-port for announced instances")
    return relay.common_settings(
        ns, prefill_urls=prefill, decode_urls=decode,
        discovery_host=ns.discovery_host, discovery_port=ns.discovery_port)


# --------------------------------------------------------------------------- builders


def build_prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """P's body: one token, not streamed, asking P to keep the KV for a remote decode."""
    return relay.prefill_body(body, PREFILL_KV_TRANSFER_PARAMS)


def decode_params_from(prefill_answer: Mapping[str, Any]) -> dict[str, Any] | None:
    """P's kv_transfer_params, verbatim; None when P sent none (D then recomputes)."""
    ktp = prefill_answer.get("kv_transfer_params")
    return ktp if isinstance(ktp, dict) else None


def build_decode_body(body: Mapping[str, Any],
                      kv_transfer_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """D's body: the client's, with P's kv_transfer_params."""
    return relay.decode_body(body, kv_transfer_params)


# --------------------------------------------------------------------------- flow


async def nixl_flow(st: ProxyState, req: ClientRequest) -> Response:
    """P (awaited) then D (relayed)."""
    p, d = st.table.pick("P"), st.table.pick("D")
    headers = relay.upstream_headers(req, st.settings.api_key)
    logger.debug("[%s] prefill %s, decode %s", req.request_id, p.base_url, d.base_url)
    with st.table.lease(p):
        answer = await relay.call_prefill(st, f"{p.base_url}/{req.route}",
                                          build_prefill_body(req.body), headers)
    ktp = decode_params_from(answer)
    logger.debug("[%s] prefill answered; sending decode", req.request_id)
    if ktp is None:
        logger.debug("[%s] prefill returned no kv_transfer_params; decode recomputes",
                     req.request_id)
    cleanup = contextlib.AsyncExitStack()
    cleanup.enter_context(st.table.lease(d))
    return await relay.decode_leg(st, req, f"{d.base_url}/{req.route}",
                                  build_decode_body(req.body, ktp), headers, cleanup=cleanup)


def create_app(settings: Settings) -> Quart:
    """The NIXL proxy app (nothing runs until it is served)."""
    return relay.create_base_app(settings, nixl_flow, __name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python nixl_proxy.py --port 8192 --prefiller-hosts ...``."""
    settings = parse_args(argv)
    relay.configure_logging(settings.log_level)
    logger.info("NIXL proxy on %s:%d; prefill %s; decode %s; discovery %s", settings.host,
                settings.port, list(settings.prefill_urls) or "-",
                list(settings.decode_urls) or "-",
                f"{settings.discovery_host}:{settings.discovery_port}"
                if settings.discovery_port else "off")
    return relay.run(create_app(settings), settings)


if __name__ == "__main__":
    sys.exit(main())
