"""A P/D proxy: an OpenAI-compatible front (``/v1/completions``,
``/v1/chat/completions``) for one prefill and one decode vLLM instance.

Each request goes first to the prefill instance, with ``max_tokens`` 1 and
``kv_transfer_params`` ``{"do_remote_decode": true}``; the params that instance answers
with (where the prompt's KV blocks are) go with the client's request, unchanged
otherwise, to the decode instance, whose answer (streamed or not) is the client's.
Works with any connector that follows vLLM's P/D convention (FreightConnector,
NixlConnector).

    python -m freight.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from typing import Any, Dict, Optional

from aiohttp import ClientSession, ClientTimeout, web

log = logging.getLogger("freight.vllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: Dict[str, Any]) -> Dict[str, Any]:
    """The request as the prefill instance gets it: one token, not streamed, and asked
    to hand its KV on."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    return out


def decode_body(body: Dict[str, Any], params: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    out = copy.deepcopy(body)
    if params:
        out["kv_transfer_params"] = params
    return out


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "proxy_error", "code": status}}, status=status)


class Proxy:
    def __init__(self, prefill: str, decode: str, timeout: float) -> None:
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.timeout = ClientTimeout(total=timeout)
        self.session: Optional[ClientSession] = None

    async def start(self, app: web.Application) -> None:
        self.session = ClientSession(timeout=self.timeout)

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"prefill": self.prefill, "decode": self.decode})

    async def forward(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"the request body is not JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}
        path = request.path
        try:
            async with self.session.post(self.prefill + path, json=prefill_body(body), headers=headers) as r:
                answer = await r.read()
                if r.status != 200:
                    return web.Response(status=r.status, body=answer, content_type="application/json")
                params = json.loads(answer).get("kv_transfer_params")
        except Exception as e:  # the prefill instance is gone, or answered nonsense
            return error(502, f"the prefill instance at {self.prefill} failed: {e!r}")
        try:
            async with self.session.post(self.decode + path, json=decode_body(body, params), headers=headers) as r:
                out = web.StreamResponse(status=r.status, headers={"Content-Type": r.content_type})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except Exception as e:
            return error(502, f"the decode instance at {self.decode} failed: {e!r}")


def app(prefill: str, decode: str, timeout: float = 600.0) -> web.Application:
    proxy = Proxy(prefill, decode, timeout)
    application = web.Application(client_max_size=64 << 20)
    application.on_startup.append(proxy.start)
    application.on_cleanup.append(proxy.stop)
    for route in ROUTES:
        application.router.add_post(route, proxy.forward)
    application.router.add_get("/health", proxy.health)
    return application


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m freight.vllm.proxy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True, help="URL of the prefill instance (http://HOST:PORT)")
    ap.add_argument("--decode", required=True, help="URL of the decode instance")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    args = ap.parse_args(argv)
    for url in (args.prefill, args.decode):
        if not url.startswith(("http://", "https://")):
            ap.error(f"{url!r}: give a URL, http://HOST:PORT")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    web.run_app(app(args.prefill, args.decode, args.timeout), host=args.host, port=args.port,
                print=lambda msg: log.info("%s", msg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
