"""Announce a vLLM instance to a proxy's discovery socket while its /health answers 200.

vLLM's NixlConnector does not announce itself; this sidecar does it for it, in the MoRIIO
dialect by default (the one every proxy here and vLLM's router understands):

    python scripts/announce.py --role P --http-address 10.0.0.5:8100 \\
        --proxy 10.0.0.1:36367

It checks ``http://ADDRESS/health`` every interval and sends one announcement (registration and
heartbeat at once) after each healthy check; while the instance is unhealthy it stays silent,
so the proxy drops the instance after its TTL. Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import registry

logger = logging.getLogger("announce")

HEALTH_TIMEOUT_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    """The sidecar's command line."""
    p = argparse.ArgumentParser(prog="announce.py", description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=["P", "D"], required=True)
    p.add_argument("--http-address", required=True, metavar="HOST:PORT",
                   help="the vLLM server's HTTP address")
    p.add_argument("--proxy", required=True, metavar="HOST:PORT",
                   help="the proxy's discovery address")
    p.add_argument("--zmq-address", default="", help="announced zmq_address (MoRIIO only)")
    p.add_argument("--dialect", choices=[d.value for d in registry.Dialect], default="moriio")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--transfer-mode", choices=["READ", "WRITE"], default=None)
    p.add_argument("--interval", type=float, default=registry.DEFAULT_ANNOUNCE_INTERVAL_S,
                   help="seconds between checks/announcements (default 3)")
    return p


def announcement_from(ns: argparse.Namespace) -> registry.Announcement:
    """The announcement for the parsed flags; raises AnnouncementError on a bad address."""
    return registry.Announcement(
        role=ns.role, base_url=registry.base_url_from_http_address(ns.http_address),
        dialect=registry.Dialect(ns.dialect), zmq_address=ns.zmq_address,
        dp_size=ns.dp_size, tp_size=ns.tp_size, transfer_mode=ns.transfer_mode)


async def healthy(session: aiohttp.ClientSession, base_url: str) -> bool:
    """Whether the instance's /health answers 200."""
    url = base_url.removesuffix("/v1") + "/health"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
            return r.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def run(ann: registry.Announcement, proxy: str, interval_s: float,
              stop: asyncio.Event) -> None:
    """Announce while healthy until ``stop`` is set."""
    announcer = registry.Announcer(ann, proxy, interval_s)
    was_healthy: bool | None = None
    try:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                ok = await healthy(session, ann.base_url)
                if ok != was_healthy:
                    logger.info("%s is %s", ann.base_url, "healthy: announcing" if ok else
                                "not healthy: silent")
                    was_healthy = ok
                if ok:
                    await announcer.send_once()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        announcer.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        ann = announcement_from(ns)
    except registry.AnnouncementError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s announce: %(message)s")

    async def go() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await run(ann, ns.proxy, ns.interval, stop)

    asyncio.run(go())
    return 0


if __name__ == "__main__":
    sys.exit(main())
