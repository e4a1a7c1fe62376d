"""What a request passes before a handler sees it, and the connection limits.

Pure ASGI middleware, outermost first: `Count` (the metrics' label: the route's template, or
"other", never the raw path), CORS when `--allowed-origins` names origins (Starlette's), then
`Guard`: the size of the head (431), both Transfer-Encoding and Content-Length (400), the Host
allow-list (400), the API key on /v1/* (and on /health and /metrics when
they are closed: 401), the Content-Type of a body (application/json only: 415), its size (the
Content-Length first, then what arrives: 413) and its arrival (all of it within the client
timeout: else 408, connection closed). A client that goes away mid-body is one log line.
`TimedH11` is uvicorn's h11 protocol with a deadline on each request's head, so that idle or
slow connections cannot hold the server's connections.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging

from starlette.routing import Match
from uvicorn.protocols.http.h11_impl import H11Protocol

from infer.serve.protocol import ApiError

log = logging.getLogger("infer.serve")
BODY_METHODS = ("POST", "PUT", "PATCH")
PROBES = ("/health", "/metrics")
ADMIN = "/v1/admin/"  # routes with a key of their own (--admin-key)


@dataclasses.dataclass(frozen=True)
class Access:
    keys: tuple[bytes, ...] = ()  # API keys (none: every route is open)
    open_probes: bool = True  # /health and /metrics answer without a key
    hosts: tuple[str, ...] = ()  # Host header names allowed (none: any)

    def host_ok(self, host: str) -> bool:
        if not self.hosts:
            return True
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") else host
        return name.strip("[]").lower() in self.hosts

    def needs_key(self, path: str) -> bool:
        """Whether `path` needs an API key (the admin routes check their own key)."""
        if path.startswith(ADMIN):
            return False
        return bool(self.keys) and (path == "/v1" or path.startswith("/v1/") or not self.open_probes)

    def key_ok(self, authorization: str) -> bool:
        """A Bearer key equal to one of the keys, compared in constant time against every key."""
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode("utf-8", "replace")
        found = False
        for key in self.keys:
            found |= hmac.compare_digest(given, key)
        return scheme.lower() == "bearer" and found


@dataclasses.dataclass(frozen=True)
class Limits:
    max_body: int = 1 << 20  # bytes of a request body (413)
    client_timeout: float = 30.0  # seconds for a request's head to arrive, then for its body (408)
    max_header: int = 16 << 10  # bytes of a request's head (431; one that arrives in pieces: h11's limit, 400)
    max_connections: int = 512  # open connections before requests get 503 (uvicorn's limit_concurrency)


def client(scope) -> str:
    host = scope.get("client")
    return f"{host[0]}:{host[1]}" if host else "a client"


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(scope.get("headers", []))}


async def answer(send, err: ApiError, close: bool = False, headers: tuple = ()) -> None:
    """An error response sent from the middleware (`close`: the connection is closed after it)."""
    body = json.dumps(err.body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def replay(body: bytes, receive):
    """A `receive` that gives the body already read, then the connection's own messages."""
    given = False

    async def again():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


class Guard:
    def __init__(self, app, access: Access, limits: Limits):
        self.app, self.access, self.limits = app, access, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope)
        if refusal is not None:
            headers = ((b"www-authenticate", b"Bearer"),) if refusal.status == 401 else ()
            return await answer(send, refusal, close=refusal.status in (400, 413, 431), headers=headers)
        if scope["method"] in BODY_METHODS:
            body = await self.read(scope, receive, send)
            if body is None:
                return
            receive = replay(body, receive)
        await self.app(scope, receive, send)

    def refusal(self, scope) -> ApiError | None:
        """Why a request is refused from its head alone (None: it may go on)."""
        headers, path = _headers(scope), scope["path"]
        size = sum(len(k) + len(v) for k, v in scope.get("headers", []))
        if size > self.limits.max_header:  # h11 bounds a head that arrives in pieces; this, one that came whole
            return ApiError(
                431,
                f"the request's headers are larger than {self.limits.max_header} bytes (--max-header-bytes)",
                code="headers_too_large",
            )
        if "transfer-encoding" in headers and "content-length" in headers:  # how requests are smuggled past proxies
            return ApiError(
                400, "a request with both Transfer-Encoding and Content-Length is refused", code="invalid_request"
            )
        host = headers.get("host", "")
        if not self.access.host_ok(host):
            return ApiError(
                400, f"the Host header {host[:100]!r} is not allowed here (--allowed-hosts)", code="invalid_host"
            )
        if self.access.needs_key(path) and not self.access.key_ok(headers.get("authorization", "")):
            return ApiError(
                401, "a valid API key is required: send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
            )
        if scope["method"] not in BODY_METHODS:
            return None
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            return ApiError(
                415,
                f"the body must be application/json, got {media[:100]!r} (the Content-Type header)",
                code="unsupported_media_type",
            )
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.limits.max_body:
            return self._too_big()
        return None

    def _too_big(self) -> ApiError:
        return ApiError(
            413, f"the body is larger than {self.limits.max_body} bytes (--max-body-bytes)", code="body_too_large"
        )

    async def read(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once it was answered (413, 408) or its client went away."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.client_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        log.warning(
                            "%s went away before its request body was complete (%d bytes came)", client(scope), size
                        )
                        return None
                    size += len(message.get("body", b""))
                    if size > self.limits.max_body:
                        await answer(send, self._too_big(), close=True)
                        return None
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            log.warning(
                "%s sent its request body too slowly: dropped after %gs (--client-timeout)",
                client(scope),
                self.limits.client_timeout,
            )
            await answer(
                send,
                ApiError(408, f"the body did not arrive within {self.limits.client_timeout:g}s", code="timeout"),
                close=True,
            )
            return None


class Count:
    """Counts every answer by route template and status (499: none was sent, the client left)."""

    def __init__(self, app, routes, counter):
        self.app, self.routes, self.counter = app, routes, counter

    def label(self, scope) -> str:
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return route.path
        return "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = "499"

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.counter.labels(self.label(scope), status).inc()


class TimedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head: a connection whose next
    request head has not arrived `head_timeout` seconds after it opened (or after its previous
    response) is closed; one that had sent part of a head is one log line."""

    head_timeout = 30.0

    def connection_made(self, transport):
        self._timer, self._waiting_for, self._partial = None, None, 0
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self):
        super().on_response_complete()
        self._arm()

    def data_received(self, data: bytes):
        if self._timer is not None:
            self._partial += len(data)
        super().data_received(data)
        if self.cycle is not self._waiting_for:  # a request's head arrived
            self._disarm()

    def connection_lost(self, exc):
        self._disarm()
        super().connection_lost(exc)

    def _arm(self):
        self._disarm()
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a pipelined request is already under way
        self._waiting_for, self._partial = self.cycle, 0
        self._timer = self.loop.call_later(self.head_timeout, self._late)

    def _disarm(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self):
        self._timer = None
        if self.cycle is self._waiting_for and not self.transport.is_closing():
            if self._partial:
                who = client({"client": self.client})
                log.warning(
                    "%s sent no complete request head within %gs: closed (--client-timeout)", who, self.head_timeout
                )
            self.transport.close()


def timed_h11(head_timeout: float) -> type[TimedH11]:
    return type("TimedH11", (TimedH11,), {"head_timeout": float(head_timeout)})
