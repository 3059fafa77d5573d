"""``freight proxy``: the command line of the P/D proxy."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional, Sequence, Tuple

DESCRIPTION = """\
An OpenAI-compatible P/D proxy: /v1/completions and /v1/chat/completions (streamed or
not) go to a prefill instance for the prompt's KV, then to a decode instance with the
kv_transfer_params the prefill instance answered. Several instances per role: the
least-loaded alive one is chosen; health checks (GET /health) take a dead one out and
put it back when it answers. No alive instance of a role: the ones whose health checks
went unanswered (busy, perhaps) are tried as a last resort; with none of those either,
503, naming each instance and why it is down.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (a decode
instance's), GET /health (200 while each role has an alive instance, 503 otherwise,
with every instance's state), GET /metrics (Prometheus).
"""

EXAMPLE = """\
example:
  freight proxy --prefill http://127.0.0.1:8100,http://127.0.0.1:8101 \\
                --decode http://127.0.0.1:8200 --listen 0.0.0.0:8000
"""


def urls(value: str) -> List[str]:
    out = []
    for url in value.split(","):
        url = url.strip()
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
            raise argparse.ArgumentTypeError(f"{url!r}: give a URL, http://HOST:PORT")
        out.append(url.rstrip("/"))
    return out


def listen(value: str) -> Tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", value
    host = host.strip("[]") or "0.0.0.0"
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: give HOST:PORT (or PORT), the port 0 to 65535")
    return host, number


def positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value!r}: give a number of seconds above 0")
    return number


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="freight proxy", description=DESCRIPTION, epilog=EXAMPLE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=urls, action="append", required=True, metavar="URL[,URL...]",
                    help="prefill instances (repeat the option or separate by commas)")
    ap.add_argument("--decode", type=urls, action="append", required=True, metavar="URL[,URL...]",
                    help="decode instances")
    ap.add_argument("--listen", type=listen, default=("127.0.0.1", 8000), metavar="HOST:PORT",
                    help="address to serve on (default 127.0.0.1:8000)")
    ap.add_argument("--timeout", type=positive, default=600.0, metavar="S",
                    help="seconds a request to an instance may take (default 600)")
    ap.add_argument("--health-interval", type=positive, default=2.0, metavar="S",
                    help="seconds between health checks of each instance (default 2)")
    ap.add_argument("--health-timeout", type=positive, default=5.0, metavar="S",
                    help="seconds a health check waits for its answer (default 5)")
    ap.add_argument("--fails-to-down", type=int, default=2, metavar="N",
                    help="failed health checks in a row that take an instance out (default 2; a refused "
                         "connection takes it out at once)")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warn", "warning", "error"),
                    help="log level (default info)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    prefill = [u for group in args.prefill for u in group]
    decode = [u for group in args.decode for u in group]
    if args.fails_to_down < 1:
        ap.error(f"--fails-to-down {args.fails_to_down}: give at least 1")
    try:
        from aiohttp import web

        from .server import Options, app
    except ImportError as e:
        print(f"freight proxy: {e.name or e} is not installed: pip install 'freight[serve]' "
              "(aiohttp and prometheus_client)", file=sys.stderr)
        return 2
    logging.basicConfig(level={"warn": "WARNING"}.get(args.log_level, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("freight.proxy")
    options = Options(timeout=args.timeout, health_interval=args.health_interval,
                      health_timeout=args.health_timeout, fails_to_down=args.fails_to_down)
    try:
        application = app(prefill, decode, options)
    except ValueError as e:
        ap.error(str(e))
    host, port = args.listen
    log.info("prefill %s, decode %s", ", ".join(prefill), ", ".join(decode))
    try:
        web.run_app(application, host=host, port=port, print=lambda msg: log.info("%s", msg),
                    access_log=None)
    except OSError as e:
        print(f"freight proxy: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0
