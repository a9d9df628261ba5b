"""`kvhal proxy`: the P/D proxy in front of prefiller and decoder vLLM servers.

See `kvhal proxy --help`; the proxy itself is `proxy.serve` (it needs the `proxy` extra,
aiohttp, imported only when the verb runs).
"""
from __future__ import annotations

import argparse
import asyncio
import logging

from kvhal.argtypes import non_negative_float

from .backends import parse_decoder, parse_prefiller

ORDERS = ("prefill-first", "concurrent", "decode-first")


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535 (0 = any free port), got "
                                         f"{text!r}")
    return int(text)


def _positive_seconds(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `proxy` verb."""
    p = sub.add_parser(
        "proxy", help="P/D proxy: prefill leg to a prefiller, decode leg to a decoder",
        description="OpenAI /v1/completions and /v1/chat/completions in; each request's "
        "prefill leg (max_tokens 1, kv_transfer_params.remote_decoder) goes to a prefiller, "
        "its decode leg (kv_transfer_params.remote_prefiller naming the prefiller's p2p "
        "address) to a decoder, whose answer is streamed back. GET /health reports every "
        "backend. Stops gracefully on SIGTERM/SIGINT.")
    p.add_argument("--prefiller", action="append", required=True, type=parse_prefiller,
                   metavar="URL,P2P_HOST:P2P_PORT[,DP_SIZE]",
                   help="a prefiller's vLLM server and where decoders reach its p2p tier "
                   "(its p2p host and port; DP_SIZE data-parallel ranks use ports "
                   "P2P_PORT..P2P_PORT+DP_SIZE-1); repeatable")
    p.add_argument("--decoder", action="append", required=True, type=parse_decoder,
                   metavar="URL", help="a decoder's vLLM server; repeatable")
    p.add_argument("--order", choices=ORDERS, default="prefill-first",
                   help="prefill-first: decode leg after the prefill leg answered (vLLM's "
                   "reference proxy); concurrent: both at once (llm-d); decode-first: decode "
                   "leg, then prefill leg (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000,
                   help="listen port, 0 = any free port (default: %(default)s)")
    p.add_argument("--health-interval-s", type=_positive_seconds, default=2.0,
                   help="seconds between /health polls of the backends (default: %(default)s)")
    p.add_argument("--connect-timeout-s", type=_positive_seconds, default=5.0,
                   help="seconds to connect to a backend (default: %(default)s)")
    p.add_argument("--prefill-timeout-s", type=_positive_seconds, default=300.0,
                   help="seconds a prefill leg may take; prefill-first then decodes without "
                   "it (default: %(default)s)")
    p.add_argument("--shutdown-timeout-s", type=_positive_seconds, default=60.0,
                   help="seconds requests in flight get to finish on SIGTERM/SIGINT "
                   "(default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a graceful shutdown."""
    try:
        from .proxy import Order, ProxyConfig, serve
    except ImportError as exc:
        raise RuntimeError(f"kvhal proxy needs the `proxy` extra (pip install "
                           f"'kvhal[proxy]'): {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s")
    config = ProxyConfig(tuple(args.prefiller), tuple(args.decoder), Order(args.order),
                         args.host, args.port, args.health_interval_s, args.connect_timeout_s,
                         args.prefill_timeout_s, args.shutdown_timeout_s)
    asyncio.run(serve(config))
    return 0
