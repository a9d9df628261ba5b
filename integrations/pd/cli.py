"""`kvhal proxy`: the P/D proxy in front of prefiller and decoder vLLM servers, or the fleet
router in front of N equal instances (`--route`, `--instance`).

See `kvhal proxy --help`; the P/D proxy is `proxy.Proxy`, the fleet router `fleet.Fleet` (they
need the `proxy` extra: aiohttp, pyzmq, msgspec, imported only when the verb runs).
"""
from __future__ import annotations

import argparse
import asyncio
import logging

from kvhal.argtypes import listen_port, positive_int, positive_seconds

from .backends import FIRST_BYTE_TIMEOUT_S, parse_decoder, parse_prefiller
from .route import POLICIES, parse_instance

ORDERS = ("prefill-first", "concurrent", "decode-first")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `proxy` verb."""
    p = sub.add_parser(
        "proxy", help="P/D proxy (prefill leg to a prefiller, decode leg to a decoder), or "
        "a KV-aware router in front of N equal instances (--route)",
        description="OpenAI /v1/completions and /v1/chat/completions in. P/D mode "
        "(--prefiller, --decoder): each request's prefill leg (max_tokens 1, "
        "kv_transfer_params.remote_decoder) goes to a prefiller, its decode leg "
        "(kv_transfer_params.remote_prefiller naming the prefiller's p2p address) to a "
        "decoder, whose answer is streamed back. Fleet mode (--route, --instance): each "
        "request goes to one instance, chosen by the policy from the instances' KV events "
        "and load; GET /router/stats reports the routing. GET /health reports every "
        "backend. Stops gracefully on SIGTERM/SIGINT.")
    p.add_argument("--prefiller", action="append", type=parse_prefiller,
                   metavar="URL,P2P_HOST:P2P_PORT[,DP_SIZE]",
                   help="a prefiller's vLLM server and where decoders reach its p2p tier "
                   "(its p2p host and port; DP_SIZE data-parallel ranks use ports "
                   "P2P_PORT..P2P_PORT+DP_SIZE-1); repeatable")
    p.add_argument("--decoder", action="append", type=parse_decoder,
                   metavar="URL", help="a decoder's vLLM server; repeatable")
    p.add_argument("--order", choices=ORDERS, default="prefill-first",
                   help="prefill-first: decode leg after the prefill leg answered (vLLM's "
                   "reference proxy); concurrent: both at once (llm-d); decode-first: decode "
                   "leg, then prefill leg (default: %(default)s)")
    fleet = p.add_argument_group("fleet mode")
    fleet.add_argument("--route", choices=POLICIES,
                       help="fleet mode: round-robin; affinity (one conversation, one "
                       "instance); kv (the instance holding the longest prefix, weighted "
                       "device > host > disk > shared, against its load); kv-p2p (kv, and a "
                       "busy holder's prefix pulled over p2p by another instance)")
    fleet.add_argument("--instance", action="append", type=parse_instance,
                       metavar="URL[,events=ZMQ_ENDPOINT][,replay=ZMQ_ENDPOINT][,p2p=HOST:PORT]",
                       help="an instance's vLLM server, its KV-event publisher (vLLM "
                       "--kv-events-config endpoint, e.g. tcp://10.0.0.5:5557) and replay "
                       "endpoint, its kvhal p2p tier's address; repeatable")
    fleet.add_argument("--tokenizer", metavar="DIR",
                       help="the model's tokenizer (transformers) for text prompts and chat "
                       "messages; token-id prompts need none")
    fleet.add_argument("--load-tokens", type=positive_int, default=128,
                       help="prompt tokens one request in flight weighs besides those it "
                       "computes: its decode steps (default: %(default)s)")
    fleet.add_argument("--p2p-busy", type=positive_int, default=2,
                       help="kv-p2p: requests in flight at which a holder is busy and another "
                       "instance may pull its prefix (default: %(default)s)")
    fleet.add_argument("--p2p-min-tokens", type=positive_int, default=256,
                       help="kv-p2p: fewest tokens worth pulling (default: %(default)s)")
    fleet.add_argument("--replay-timeout-s", type=positive_seconds, default=2.0,
                       help="seconds an event replay may take (default: %(default)s)")
    fleet.add_argument("--first-byte-timeout-s", type=positive_seconds,
                       default=FIRST_BYTE_TIMEOUT_S,
                       help="seconds an instance may take to send the first byte of its "
                       "answer (queueing and prefill included; for a non-streamed request, "
                       "the whole generation) before it is marked unhealthy and the request "
                       "is re-sent once to another instance; also the most seconds between "
                       "two chunks of an answer, after which the answer ends incomplete "
                       "(default: %(default)s)")
    fleet.add_argument("--events-silence-s", type=positive_seconds, default=10.0,
                       help="seconds without events after requests that store blocks before "
                       "an instance's index is cleared (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument("--port", type=listen_port, default=8000,
                   help="listen port, 0 = any free port (default: %(default)s)")
    p.add_argument("--health-interval-s", type=positive_seconds, default=2.0,
                   help="seconds between /health polls of the backends (default: %(default)s)")
    p.add_argument("--connect-timeout-s", type=positive_seconds, default=5.0,
                   help="seconds to connect to a backend (default: %(default)s)")
    p.add_argument("--prefill-timeout-s", type=positive_seconds, default=300.0,
                   help="seconds a prefill leg may take; prefill-first then decodes without "
                   "it (default: %(default)s)")
    p.add_argument("--shutdown-timeout-s", type=positive_seconds, default=60.0,
                   help="seconds requests in flight get to finish on SIGTERM/SIGINT "
                   "(default: %(default)s)")
    p.set_defaults(func=run)


def _mode(args: argparse.Namespace) -> str:
    """"fleet" or "pd", from the arguments given.

    Raises:
        ValueError: a mix of both modes' arguments, or a mode's arguments missing.
    """
    fleet, pd = args.route or args.instance, args.prefiller or args.decoder
    if fleet and pd:
        raise ValueError("kvhal proxy: --route/--instance (fleet mode) and --prefiller/"
                         "--decoder (P/D mode) cannot be mixed")
    if fleet:
        if not (args.route and args.instance):
            raise ValueError("kvhal proxy: fleet mode needs --route and at least one "
                             "--instance")
        return "fleet"
    if not (args.prefiller and args.decoder):
        raise ValueError("kvhal proxy: give --prefiller and --decoder (P/D mode), or "
                         "--route and --instance (fleet mode)")
    return "pd"


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a graceful shutdown.

    Raises:
        ValueError: the arguments mix or lack a mode's (`_mode`).
        RuntimeError: the `proxy` extra is not installed.
    """
    mode = _mode(args)
    try:
        from .proxy import Order, Proxy, ProxyConfig
        if mode == "fleet":
            from .fleet import Fleet, FleetConfig
    except ImportError as exc:
        raise RuntimeError(f"kvhal proxy needs the `proxy` extra (pip install "
                           f"'kvhal[proxy]'): {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s")
    if mode == "fleet":
        asyncio.run(Fleet(FleetConfig(
            tuple(args.instance), args.route, args.tokenizer, args.host, args.port,
            args.health_interval_s, args.connect_timeout_s, args.shutdown_timeout_s,
            args.load_tokens, args.p2p_busy, args.p2p_min_tokens, args.replay_timeout_s,
            args.events_silence_s, args.first_byte_timeout_s)).run())
        return 0
    config = ProxyConfig(tuple(args.prefiller), tuple(args.decoder), Order(args.order),
                         args.host, args.port, args.health_interval_s, args.connect_timeout_s,
                         args.prefill_timeout_s, args.shutdown_timeout_s)
    asyncio.run(Proxy(config).run())
    return 0
