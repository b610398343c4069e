"""The Starlette application of the gateway: routes, error handlers, middleware, lifespan.

Starlette rather than FastAPI (docs/http.md says more): the OpenAI request shapes are checked by
hand in openai_models.py anyway (to answer 400 with OpenAI's error body and the engine's
messages, where FastAPI would answer its own 422), so FastAPI's pydantic layer would add import
time and a second validator without taking work away. `build_app` returns a plain ASGI app that
uvicorn runs (gateway_cmd.py) and tests drive.

`Gateway` is what the handlers share (`request.app.state.gateway`): the engine link, the local
tokenizer (or None), the metrics exporter, and the served model name check.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pagedrun.server.http import routes
from pagedrun.server.http.auth import BearerAuth
from pagedrun.server.http.edge import EdgeLimits
from pagedrun.server.http.engine_link import EngineLink
from pagedrun.server.http.errors import ApiError, error_body
from pagedrun.server.http.prometheus import CountRequests, MetricsExporter
from pagedrun.server.http.tokenizer_source import load_tokenizer, tokenizer_for_engine

log = logging.getLogger("pagedrun.http")

NOT_LOADED = object()  # tokenizer: not decided yet (found at start-up)


class Gateway:
    """State shared by the handlers of one app."""

    def __init__(self, link: EngineLink, tokenizer=NOT_LOADED) -> None:
        self.link = link
        self.tokenizer = tokenizer
        self.exporter = MetricsExporter()
        self.started_at = int(time.time())

    @property
    def local_tokenizer(self):
        """The gateway's tokenizer, None without one (or before start-up decided)."""
        return None if self.tokenizer is NOT_LOADED else self.tokenizer

    @property
    def decode(self):
        """token id -> its text through the local tokenizer; None without one."""
        tokenizer = self.local_tokenizer
        if tokenizer is None:
            return None
        return lambda token_id: tokenizer.decode([token_id])

    async def check_model(self, requested: str | None) -> str:
        """The served name; 404 when the request names another model (None: the served one)."""
        served = await self.link.model_name()
        if requested is not None and requested != served:
            raise ApiError(404, f"The model `{requested}` does not exist (this server serves "
                           f"`{served}`).", param="model", code="model_not_found")
        return served

    async def find_tokenizer(self) -> None:
        """The engine's model's tokenizer unless one was given: looked for at start-up, and
        again by the next request that needs it when the engine did not answer then."""
        if self.tokenizer is not NOT_LOADED:
            return
        try:
            name = (await self.link.model_info()).get("model")
        except ApiError as exc:
            log.warning("the engine did not answer MODEL_INFO (%s): the tokenizer is looked "
                        "for later", exc.message)
            return
        self.tokenizer = await asyncio.to_thread(tokenizer_for_engine, name)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"),
                        status_code=500)


def build_app(engine_endpoint: str, *, api_key: str | None = None,
              served_model_name: str | None = None, tokenizer=NOT_LOADED,
              tokenizer_model: str | None = None, timeout_s: float | None = None,
              server_public_key_file: str | None = None,
              client_secret_key_file: str | None = None,
              limits: EdgeLimits | None = None):
    """The gateway's ASGI app for the engine server at `engine_endpoint`. `tokenizer`: a
    Tokenizer object (serve --http-port passes the engine's), None for none; else loaded from
    `tokenizer_model` or the engine's MODEL_INFO at start-up. `limits`: the HTTP edge's,
    default EdgeLimits() (app.state.edge_limits: the body reads and GatewayThread's uvicorn
    read them there)."""
    link_options = {} if timeout_s is None else {"timeout_s": timeout_s}
    link = EngineLink(engine_endpoint, served_model_name=served_model_name,
                      server_public_key_file=server_public_key_file,
                      client_secret_key_file=client_secret_key_file, **link_options)
    if tokenizer is NOT_LOADED and tokenizer_model is not None:
        tokenizer = load_tokenizer(tokenizer_model)  # asked for: a failure stops the start
    gateway = Gateway(link, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await link.start()
        await gateway.find_tokenizer()
        try:
            yield
        finally:
            await link.close()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/models", routes.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", routes.retrieve_model, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/version", routes.version, methods=["GET"]),
            Route("/tokenize", routes.tokenize, methods=["POST"]),
            Route("/detokenize", routes.detokenize, methods=["POST"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                            Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    app.state.edge_limits = limits if limits is not None else EdgeLimits()
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(CountRequests, exporter=gateway.exporter)
    return app
