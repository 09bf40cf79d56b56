"""`verispec serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from verispec.cli import COMMANDS
from verispec.cli.options import add_draft_options, add_model_arguments, as_argparse_type, draft_options
from verispec.core.errors import VerispecError
from verispec.methods import DEFAULT_METHOD, METHODS, PLAIN
from verispec.model.loading import load_model


def add_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve", help=COMMANDS["serve"],
        description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics "
        "(Prometheus) and a playground page at /. Requests join and leave one running batch.")
    add_model_arguments(serve)
    serve.add_argument("--method", action="append", choices=list(METHODS),
                       help="a method requests may choose (repeatable; the first is the default; "
                       f"default: {DEFAULT_METHOD}, then {PLAIN})")
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    serve.add_argument("--port", type=as_argparse_type(port_number), default=8000,
                       help="default: 8000 (0: any free port)")
    serve.add_argument("--max-batch", type=int, default=16,
                       help="sequences decoded together at most (default: 16)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting for the batch at most; more get 429 (default: 64)")
    serve.add_argument("--drain-seconds", type=as_argparse_type(drain_seconds), default=30.0,
                       help="on SIGTERM, how long requests in flight may take to finish while new "
                       "ones get 503 (default: 30)")
    serve.add_argument("--max-kv-tokens", type=int, default=None,
                       help="KV cache tokens all running requests may reserve together (n x (prompt + "
                       "max_tokens + 160)); a request that does not fit waits, one that never could "
                       "gets 400 (default: a quarter of the free memory at start-up)")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every path but /health and /metrics "
                       "(default: $VERISPEC_API_KEY; none: open)")
    serve.add_argument("--cors-origin", action="append", default=None,
                       help="an origin browsers may call the API from (repeatable; default: none)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20,
                       help="the largest request body; larger get 413 (default: 1 MiB)")
    add_draft_options(serve, method_flag=False)
    serve.set_defaults(func=run_command)


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise VerispecError(f"a port is 0..65535, got {text!r}")
    return port


def drain_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise VerispecError(f"drain seconds must be a finite number >= 0, got {text!r}")
    return seconds


def check_listening(host: str, port: int) -> None:
    """Fail before the model loads (seconds) where the address cannot be served: in use, not
    this machine's, not an address."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        with socket.create_server((host, port), family=family):  # IPv6 hosts too
            pass
    except (OSError, OverflowError) as error:
        raise VerispecError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def run_command(args: argparse.Namespace) -> int:
    from verispec.server import create_app, serve

    check_listening(args.host, args.port)
    target = load_model(args.model, args.dtype, args.device)
    app = create_app(target, args.method, max_batch=args.max_batch, max_queue=args.max_queue,
                     max_kv_tokens=args.max_kv_tokens, host=args.host,
                     api_key=args.api_key or os.environ.get("VERISPEC_API_KEY") or None,
                     cors_origins=args.cors_origin, max_body=args.max_body_bytes,
                     options=draft_options(args))
    print(f"verispec: serving {target.name} on http://{args.host}:{args.port}/ (playground there, "
          f"OpenAI API under /v1, metrics at /metrics)", file=sys.stderr)
    serve(app, args.host, args.port, args.drain_seconds)
    return 0
