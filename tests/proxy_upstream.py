"""A stand-in for one vLLM instance behind the P/D proxy, as a process of its own:
``python proxy_upstream.py NAME PORT [--delay S] [--no-params] [--health-status N]
[--health-delay S]``.

It follows vLLM's P/D convention only as far as the proxy can see: a request with
``kv_transfer_params.do_remote_decode`` (a prefill) is answered with params naming this
instance; any other request (a decode) is answered with what it was sent, streamed as
server-sent events when it asks for ``stream``. Every answer names the instance and the
``X-Request-Id`` it got; ``GET /seen`` lists the requests received. A decode request
with ``"hold": true`` is answered only after ``GET /release``; one with ``"crash": true``
(streamed) ends this process after its second chunk; the first request with
``"drop_once": true`` has its connection closed unanswered. ``--health-delay`` holds
each health check's answer (an overloaded instance) until ``GET /heal``. Used by
tests/test_proxy.py; the real instances are in tests/test_vllm.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("port", type=int)
    ap.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    ap.add_argument("--no-params", action="store_true", help="answer prefills without kv_transfer_params")
    ap.add_argument("--health-status", type=int, default=200)
    ap.add_argument("--health-delay", type=float, default=0.0, help="seconds before each health check's answer")
    args = ap.parse_args()
    seen = []
    released = asyncio.Event()
    dropped = []

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id")
        seen.append({"path": request.path, "request_id": rid, "body": body})
        await asyncio.sleep(args.delay)
        if body.get("hold") and not (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            # Held in flight until GET /release.
            await released.wait()
        if body.get("drop_once") and not dropped:
            # Closes the connection without an answer, once: as a server closing an
            # idle keep-alive connection just as the proxy reuses it.
            dropped.append(True)
            request.transport.close()
            return web.Response()
        if body.get("prompt") == "bad":
            return web.json_response({"error": {"message": "bad prompt"}}, status=400)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            answer = {"id": rid, "instance": args.name, "choices": [{"text": "x"}]}
            if not args.no_params:
                answer["kv_transfer_params"] = {"do_remote_prefill": True, "from": args.name}
            return web.json_response(answer)
        words = [f"{args.name}:{w}" for w in str(body.get("prompt", "")).split()]
        if not body.get("stream"):
            return web.json_response({"id": rid, "instance": args.name, "params": params,
                                      "choices": [{"text": " ".join(words)}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, w in enumerate(words):
            chunk = {"id": rid, "instance": args.name, "params": params, "choices": [{"text": w}]}
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
            if body.get("crash") and i == 1:
                os._exit(1)  # dies mid-answer
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        await asyncio.sleep(args.health_delay)
        return web.Response(status=args.health_status)

    async def heal(request: web.Request) -> web.Response:
        args.health_delay = 0.0
        return web.json_response({})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "instance": args.name}]})

    async def list_seen(request: web.Request) -> web.Response:
        return web.json_response(seen)

    async def release(request: web.Request) -> web.Response:
        released.set()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/seen", list_seen)
    app.router.add_get("/release", release)
    app.router.add_get("/heal", heal)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
