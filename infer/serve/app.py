"""The HTTP side (FastAPI): OpenAI's routes over the scheduler.

A handler reads the body (already checked by `infer.serve.guard`), turns it into rows off the
event loop (`infer.serve.jobs.plan`: parsing, tokenizing, templating run in a thread pool), submits
them and answers (`infer.serve.respond`: a whole response or a stream).
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from infer.serve import jobs, respond
from infer.serve.guard import Access, Count, Guard, Limits
from infer.serve.jobs import Served
from infer.serve.protocol import ApiError
from infer.serve.scheduler import Closed

log = logging.getLogger("infer.serve")
RETRY_AFTER_S = "1"


def create_app(served: Served, access: Access = Access(), limits: Limits = Limits(), origins: tuple[str, ...] = ()):
    """The ASGI app: the routes inside the guard, CORS (when origins are allowed), the count."""
    app = _routes(served)
    guarded = Guard(app, access, limits)
    if origins:
        guarded = CORSMiddleware(
            guarded,
            allow_origins=list(origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    return Count(guarded, app.routes, served.metrics.requests)


def _routes(served: Served) -> FastAPI:
    app = FastAPI(title="peagle-jax", docs_url=None, redoc_url=None, openapi_url=None)
    _error_handlers(app)

    @app.get("/health")
    async def health():
        sched = served.scheduler
        if sched.failure is not None:
            return JSONResponse({"status": "failed"}, status_code=503)
        if sched.closing:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(served.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_card(served)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != served.model:
            raise ApiError(
                404,
                f"model {model[:100]!r} is not served here; this server serves {served.model!r}",
                "model",
                "model_not_found",
            )
        return _card(served)

    if served.admin_keys:
        _admin_routes(app, served)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(served, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(served, request, chat=True)

    return app


def _card(served: Served) -> dict:
    card = {
        "id": served.model,
        "object": "model",
        "created": served.created,
        "owned_by": "peagle-jax",
        "max_model_len": served.max_len,
    }
    if served.heads is not None:
        card["head"] = served.heads.current.card()
    return card


def _admin_routes(app: FastAPI, served: Served) -> None:
    """POST /v1/admin/head {"path": DIR}: the head swapped without a restart (`infer.serve.heads`)."""
    keys = Access(served.admin_keys)

    @app.post("/v1/admin/head")
    async def head(request: Request):
        if not keys.key_ok(request.headers.get("authorization", "")):
            raise ApiError(401, "the admin key is required: 'Authorization: Bearer ADMIN_KEY'", code="invalid_api_key")
        path = _head_path(await request.body())
        if served.heads is None:
            raise ApiError(400, "this server drafts with no head (--mode none): there is none to swap", "path")
        before = served.heads.current
        try:
            now = await asyncio.get_running_loop().run_in_executor(None, served.heads.swap, path)
        except Closed as err:
            raise ApiError(503, str(err), code="shutting_down") from None
        except (ValueError, OSError) as err:
            message = " ".join(str(err).split())[:500]
            raise ApiError(400, f"path: the head at {path[:200]!r} was not swapped in: {message}", "path") from None
        return {"head": now.card(), "previous": before.card()}


def _head_path(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ApiError(400, "the body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict) or not isinstance(body.get("path"), str) or not body["path"]:
        raise ApiError(400, 'the body must be {"path": "a head folder or Hub id"}', "path")
    return body["path"]


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request, err: ApiError):
        headers = {"Retry-After": RETRY_AFTER_S} if err.status == 503 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_request, err: HTTPException):
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def crash(_request, err: Exception):
        log.exception("request failed")
        return JSONResponse(ApiError(500, f"{type(err).__name__}: {err}").body(), status_code=500)


async def _generate(served: Served, request: Request, chat: bool):
    raw = await request.body()
    plan = await asyncio.get_running_loop().run_in_executor(served.pool, jobs.plan, served, raw, chat)
    call = respond.Call(served, plan)
    call.submit()
    if plan.body.stream:
        return StreamingResponse(respond.stream(call), media_type="text/event-stream")
    return await respond.collect(call, request)
