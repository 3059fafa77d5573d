"""The proxy's HTTP server (aiohttp): the OpenAI routes, health checks of every
instance, ``/health`` and ``/metrics``.

A request goes to the least-loaded alive prefill instance, then to the least-loaded
alive decode instance. An instance that refuses the connection is taken out and the
request goes to the next one. A connection that breaks before the answer begins (a
server may close an idle keep-alive connection just as it is reused) gets the request
again, once, on a new connection, before its instance is taken out (a prefill is safe
to repeat: blocks nobody reads go when their lease ends). A decode instance that breaks
off mid-answer cuts the client's answer. An instance's own error status (a bad
request, say) is passed on to the client as it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Union

from aiohttp import (ClientConnectionError, ClientConnectorError, ClientPayloadError, ClientSession, ClientTimeout,
                     TCPConnector, web)

from .bodies import decode_body, prefill_body
from .metrics import Metrics
from .pool import Instance, NoInstance, Pool

log = logging.getLogger("freight.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
PROXY: "web.AppKey[Proxy]" = web.AppKey("proxy")
# Headers of the client's request that go on to the instances.
PASSED_HEADERS = ("authorization", "x-request-id")
# A connection to an instance that broke (reset, closed, its answer cut short). Only a
# refused connection (ClientConnectorError, a subclass) or a failed health check says
# the instance is down: a server closes keep-alive connections it has idled (uvicorn
# after 5 s), and one can close just as the proxy reuses it.
BROKEN = (ClientConnectionError, ClientPayloadError)
# Seconds the proxy keeps an idle connection to an instance: under uvicorn's 5.
KEEPALIVE_S = 2.0


@dataclass
class Options:
    timeout: float = 600.0
    health_interval: float = 2.0
    health_timeout: float = 5.0
    fails_to_down: int = 2


def error(status: int, message: str, request_id: Optional[str] = None) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.json_response({"error": {"message": message, "type": "proxy_error", "code": status}},
                             status=status, headers=headers)


class ClientGone(Exception):
    """The client closed its connection while its answer was being written (kept apart
    from the instance's connection errors: aiohttp's reset error is one of those too)."""


async def relay(out: web.StreamResponse, request: web.Request, chunk: Optional[bytes]) -> None:
    """Writes ``chunk`` to the client (prepares the answer first; ``None``: ends it)."""
    try:
        if not out.prepared:
            await out.prepare(request)
        if chunk is None:
            await out.write_eof()
        else:
            await out.write(chunk)
    except ConnectionResetError as e:
        raise ClientGone() from e


def describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text


class Proxy:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], options: Options = Options()) -> None:
        self.options = options
        self.pools = {"prefill": Pool.of("prefill", [u.rstrip("/") for u in prefill], options.fails_to_down),
                      "decode": Pool.of("decode", [u.rstrip("/") for u in decode], options.fails_to_down)}
        self.metrics = Metrics()
        self.session: Optional[ClientSession] = None
        self.watcher: Optional[asyncio.Task] = None
        for pool in self.pools.values():
            for inst in pool.instances:
                self._show(inst)

    # -- life ---------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        # No cap on connections per instance: the pools choose where requests go.
        self.session = ClientSession(timeout=ClientTimeout(total=self.options.timeout),
                                     connector=TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))
        self.watcher = asyncio.create_task(self._watch())

    async def stop(self, app: web.Application) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            try:
                await self.watcher
            except asyncio.CancelledError:
                pass
        if self.session is not None:
            await self.session.close()

    # -- health ---------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._check(pool, inst) for pool in self.pools.values()
                                   for inst in pool.instances))
            await asyncio.sleep(self.options.health_interval)

    async def _check(self, pool: Pool, inst: Instance) -> None:
        assert self.session is not None
        try:
            async with self.session.get(inst.url + "/health",
                                        timeout=ClientTimeout(total=self.options.health_timeout)) as r:
                await r.read()
                ok, reason, unanswered = r.status == 200, f"health check answered HTTP {r.status}", False
        except asyncio.TimeoutError:
            ok, reason, unanswered = False, f"health check got no answer in {self.options.health_timeout:g} s", True
        except ClientConnectionError as e:
            # Nobody listens there (or the connection broke): down at once.
            if inst.alive:
                log.warning("%s instance %s is down: health check: %s", pool.role, inst.url, describe(e))
            pool.connection_failed(inst, f"health check: {describe(e)}")
            self._show(inst)
            return
        if ok:
            if pool.check_passed(inst):
                log.info("%s instance %s is back", pool.role, inst.url)
        elif pool.check_failed(inst, reason, unanswered):
            log.warning("%s instance %s is down: %s", pool.role, inst.url, reason)
        self._show(inst)

    def _show(self, inst: Instance) -> None:
        self.metrics.up.labels(inst.role, inst.url).set(1 if inst.alive else 0)
        self.metrics.in_flight.labels(inst.role, inst.url).set(inst.in_flight)

    def _broke(self, pool: Pool, inst: Instance, e: BaseException, tried: List[Instance], second_chance: Set[str],
               request_id: str) -> None:
        """A connection to ``inst`` broke before its answer began. The first time in a
        request the instance may be tried again (on a new connection); the second time
        it is taken out."""
        if inst.url in second_chance:
            self._lost(pool, inst, e)
            return
        second_chance.add(inst.url)
        tried.remove(inst)
        self.metrics.upstream.labels(pool.role, inst.url, "connection_error").inc()
        log.info("request %s: connection to %s instance %s broke (%s); trying again", request_id, pool.role,
                 inst.url, describe(e))

    def _lost(self, pool: Pool, inst: Instance, e: BaseException) -> None:
        if inst.alive:
            log.warning("%s instance %s is down: %s", pool.role, inst.url, describe(e))
        pool.connection_failed(inst, describe(e))
        self.metrics.upstream.labels(pool.role, inst.url, "connection_error").inc()
        self._show(inst)

    # -- routes ---------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        state = {role: pool.state() for role, pool in self.pools.items()}
        ok = all(pool.alive() for pool in self.pools.values())
        return web.json_response({"ok": ok, **state}, status=200 if ok else 503)

    async def render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        pool = self.pools["decode"]
        try:
            inst = pool.pick()
        except NoInstance as e:
            return error(503, str(e))
        try:
            async with self.session.get(inst.url + request.path) as r:
                return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
        except (ClientConnectionError, asyncio.TimeoutError) as e:
            return error(502, f"the decode instance at {inst.url} failed: {describe(e)}")

    async def forward(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        response = await self._forward(request, request_id, started)
        self.metrics.requests.labels(request.path, str(response.status)).inc()
        return response

    async def _forward(self, request: web.Request, request_id: str, started: float) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"the request body is not JSON: {e}", request_id)
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", request_id)
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        headers["X-Request-Id"] = request_id
        got = await self._prefill(request.path, body, headers, request_id)
        if isinstance(got, web.Response):
            return got
        return await self._decode(request, decode_body(body, got), headers, request_id, started)

    def _take(self, role: str, tried: List[Instance], request_id: str) -> Union[Instance, web.Response]:
        """The next instance of ``role`` for a request, counted in flight (and added to
        ``tried``), or the error response when none is left."""
        pool = self.pools[role]
        try:
            inst = pool.pick(exclude=tried)
        except NoInstance as e:
            self.metrics.errors.labels(role, "connection" if tried else "no_instance").inc()
            return error(502 if tried else 503, str(e), request_id)
        if not inst.alive:
            log.warning("request %s: no %s instance is alive; sending it to %s, whose health checks go "
                        "unanswered (%s)", request_id, role, inst.url, inst.reason)
            self.metrics.last_resort.labels(role, inst.url).inc()
        tried.append(inst)
        pool.acquire(inst)
        self._show(inst)
        return inst

    def _give_back(self, pool: Pool, inst: Instance) -> None:
        pool.release(inst)
        self._show(inst)

    async def _prefill(self, path: str, body: Dict[str, Any], headers: Dict[str, str],
                       request_id: str) -> Any:
        """The prefill's ``kv_transfer_params``, or the response that ends the request."""
        assert self.session is not None
        pool, m = self.pools["prefill"], self.metrics
        tried: List[Instance] = []
        second_chance: Set[str] = set()
        sent_body = prefill_body(body)
        while True:
            inst = self._take("prefill", tried, request_id)
            if isinstance(inst, web.Response):
                return inst
            sent = time.monotonic()
            try:
                async with self.session.post(inst.url + path, json=sent_body, headers=headers) as r:
                    m.ttft.labels("prefill").observe(time.monotonic() - sent)
                    answer = await r.read()
                    status, content_type = r.status, r.content_type
            except asyncio.TimeoutError:
                m.upstream.labels("prefill", inst.url, "timeout").inc()
                m.errors.labels("prefill", "timeout").inc()
                return error(504, f"the prefill instance at {inst.url} did not answer in {self.options.timeout:g} s",
                             request_id)
            except ClientConnectorError as e:
                self._lost(pool, inst, e)
                log.info("request %s: prefill instance %s cannot be reached (%s); trying another", request_id,
                         inst.url, describe(e))
                continue
            except BROKEN as e:
                self._broke(pool, inst, e, tried, second_chance, request_id)
                continue
            finally:
                self._give_back(pool, inst)
            m.latency.labels("prefill").observe(time.monotonic() - sent)
            if status != 200:
                m.upstream.labels("prefill", inst.url, "http_error").inc()
                m.errors.labels("prefill", "http_status").inc()
                return web.Response(status=status, body=answer, content_type=content_type,
                                    headers={"X-Request-Id": request_id})
            try:
                params = json.loads(answer).get("kv_transfer_params")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                params, why = None, f"its answer is not a JSON object ({e})"
            else:
                why = ("its answer has no kv_transfer_params: is it started with a KV connector "
                       "(--kv-transfer-config, kv_role kv_producer or kv_both)?")
            if not isinstance(params, dict):
                m.upstream.labels("prefill", inst.url, "bad_answer").inc()
                m.errors.labels("prefill", "bad_answer").inc()
                return error(502, f"the prefill instance at {inst.url} answered, but {why}", request_id)
            m.upstream.labels("prefill", inst.url, "ok").inc()
            return params

    async def _decode(self, request: web.Request, body: Dict[str, Any], headers: Dict[str, str],
                      request_id: str, started: float) -> web.StreamResponse:
        assert self.session is not None
        pool, m = self.pools["decode"], self.metrics
        tried: List[Instance] = []
        second_chance: Set[str] = set()
        while True:
            inst = self._take("decode", tried, request_id)
            if isinstance(inst, web.Response):
                return inst
            sent = time.monotonic()
            out: Optional[web.StreamResponse] = None
            try:
                async with self.session.post(inst.url + request.path, json=body, headers=headers) as r:
                    out = web.StreamResponse(status=r.status, headers={"X-Request-Id": request_id})
                    out.content_type = r.content_type
                    if r.charset:
                        out.charset = r.charset
                    first = True
                    async for chunk in r.content.iter_any():
                        if first:
                            now = time.monotonic()
                            m.ttft.labels("decode").observe(now - sent)
                            m.ttft.labels("client").observe(now - started)
                            first = False
                        await relay(out, request, chunk)
                    await relay(out, request, None)
                    ok = r.status == 200
            except ClientConnectorError as e:
                # Nothing reached the instance: another one may serve it.
                self._lost(pool, inst, e)
                continue
            except asyncio.TimeoutError:
                m.upstream.labels("decode", inst.url, "timeout").inc()
                m.errors.labels("decode", "timeout").inc()
                if out is not None and out.prepared:
                    return out
                return error(504, f"the decode instance at {inst.url} did not answer in {self.options.timeout:g} s",
                             request_id)
            except BROKEN as e:
                if out is None or not out.prepared:
                    # Nothing of the answer reached the client yet.
                    self._broke(pool, inst, e, tried, second_chance, request_id)
                    continue
                self._lost(pool, inst, e)
                m.errors.labels("decode", "connection").inc()
                if out is not None and out.prepared:
                    # Part of the answer is with the client: break its connection too, so
                    # that it sees the answer cut short rather than ended.
                    log.warning("request %s: decode instance %s broke off its answer: %s", request_id, inst.url,
                                describe(e))
                    if request.transport is not None:
                        request.transport.close()
                    return out
                return error(502, f"the decode instance at {inst.url} failed: {describe(e)}", request_id)
            except ClientGone:
                # The client went away; the rest of the instance's answer goes with it.
                log.info("request %s: the client closed its connection", request_id)
                m.errors.labels("client", "gone").inc()
                assert out is not None
                return out
            finally:
                self._give_back(pool, inst)
            done = time.monotonic()
            m.latency.labels("decode").observe(done - sent)
            m.latency.labels("client").observe(done - started)
            m.upstream.labels("decode", inst.url, "ok" if ok else "http_error").inc()
            if not ok:
                m.errors.labels("decode", "http_status").inc()
            return out


def app(prefill: Sequence[str], decode: Sequence[str], options: Options = Options()) -> web.Application:
    proxy = Proxy(prefill, decode, options)
    application = web.Application(client_max_size=64 << 20)
    application[PROXY] = proxy
    application.on_startup.append(proxy.start)
    application.on_cleanup.append(proxy.stop)
    for route in ROUTES:
        application.router.add_post(route, proxy.forward)
    application.router.add_get("/v1/models", proxy.models)
    application.router.add_get("/health", proxy.health)
    application.router.add_get("/metrics", proxy.render_metrics)
    return application
