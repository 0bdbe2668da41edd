"""The OpenAI-compatible HTTP server: FastAPI app factory, lifespan, routes, auth, `run_server`.

Owns `ServerConfig`, the routes (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`
(with GET `/v1/responses/{id}` and POST `/v1/responses/{id}/cancel`), `/v1/messages` (and
`/v1/messages/count_tokens`), `/v1/models`, `/tokenize`, `/detokenize`, `/health`, `/version`,
`/metrics`, the operator's `/v1/kv` and `/v1/config` (ops_routes.py); `/tokenizer_info` when
enabled;
with dev endpoints enabled, `/reset_prefix_cache`, `/sleep`, `/wake_up`, `/is_sleeping`; with a
profiler configured, `/start_profile`, `/stop_profile`), the API-key check (every path but
`/health`), opt-in CORS, the connection limits (header and body read timeouts, keep-alive, a
connection limit), and the process lifecycle: SIGTERM stops accepting connections, lets
in-flight responses finish, and shortly before `shutdown_timeout_s` ends the streams still
running with an error event and [DONE], stops the engine thread and exits 0. Request bodies
are decoded, rendered and tokenized in a few preparation threads, never on the event loop.
The engine core runs in a process of its own (AsyncMPEngine) unless `engine_in_process`; if
that process dies, the server stops and `run_server` returns 1.

Must not: step the engine (the engine-core process or the AsyncEngine thread does) or hold
per-request state.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_fastapi_instrumentator import Instrumentator

import octavo
from octavo.config import EngineArgs
from octavo.engine.async_engine import AsyncEngine
from octavo.engine.core import SLEEP_LEVELS, check_sleep, check_wake_up_tags
from octavo.engine.core_client import AsyncMPEngine
from octavo.engine.llm_engine import LLMEngine
from octavo.entrypoints.server.chat_render import chat_render_from
from octavo.entrypoints.server.errors import (
    OpenAIError,
    bad_request,
    error_body,
    from_value_error,
    install_error_handlers,
)
from octavo.entrypoints.server.ops_routes import add_ops_routes
from octavo.entrypoints.server.protocol import (
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from octavo.entrypoints.server.reasoning_parsers import get_reasoning_parser
from octavo.entrypoints.server.request_body import parse_body, read_body
from octavo.entrypoints.server.serving_chat import OpenAIServingChat
from octavo.entrypoints.server.serving_common import ServingContext, check_model, prepare
from octavo.entrypoints.server.serving_completion import OpenAIServingCompletion
from octavo.entrypoints.server.serving_embedding import OpenAIServingEmbedding
from octavo.entrypoints.server.serving_messages import AnthropicServingMessages
from octavo.entrypoints.server.serving_responses import OpenAIServingResponses
from octavo.entrypoints.server.tokenizer_info import tokenizer_info
from octavo.entrypoints.server.tool_parsers.tool_choice import ToolServing, check_tools
from octavo.metrics.prometheus import PrometheusStatLogger, stat_logger_for

logger = logging.getLogger(__name__)

# Paths a client may call without the API key.
OPEN_PATHS = frozenset({"/health", "/ping"})
# Paths the HTTP metrics leave out (as vLLM's): scrapes and health checks, and /v1/kv, which
# `octavo top` reads every second.
UNMETERED_PATHS = ("/metrics", "/health", "/ping", "/version", "/v1/kv")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # A Unix domain socket to serve on instead of host and port (vLLM's --uds).
    uds: str | None = None
    # Every path but /health needs `Authorization: Bearer KEY` with one of these (vLLM's
    # --api-key, which may be given several keys); a single string is one key.
    api_key: str | tuple[str, ...] | None = None
    # CORS is off unless origins are listed ("*" allows any); what it allows of them.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # uvicorn's own settings (vLLM's flags of the same names).
    uvicorn_log_level: str | None = None  # None: make_server's log_level
    disable_uvicorn_access_log: bool = False
    # Paths whose requests get no access-log line (vLLM's --disable-access-log-for-endpoints).
    disable_access_log_for_endpoints: tuple[str, ...] = ()
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    ssl_ciphers: str | None = None
    # Load the key, certificate and CA files again when they change while serving.
    enable_ssl_refresh: bool = False
    # FastAPI's /docs, /redoc and /openapi.json (served unless this is set, as vLLM does).
    disable_fastapi_docs: bool = False
    # The role of chat responses; whether every stream ends with usage; whether responses
    # carry X-Request-Id (the request's own, or a new one).
    response_role: str = "assistant"
    enable_force_include_usage: bool = False
    enable_request_id_headers: bool = False
    # Keyword arguments every chat template rendering gets (a request's own win key by key),
    # and whether logprobs name tokens `token_id:ID` rather than by their text (vLLM's flags).
    default_chat_template_kwargs: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool = False
    # Whether a chat request (or /tokenize) may bring its own `chat_template` (vLLM's
    # --trust-request-chat-template: without it, such a request is a 400 naming the field).
    trust_request_chat_template: bool = False
    # GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint).
    enable_tokenizer_info_endpoint: bool = False
    # Larger bodies get 413 before they are parsed.
    max_request_body_bytes: int = 16 << 20
    # On SIGTERM, how long in-flight responses may run before they are ended.
    shutdown_timeout_s: float = 30.0
    # A connection must send its request headers within this, and its body within the other,
    # else it is closed (408 for a body); idle keep-alive connections close after the third.
    header_read_timeout_s: float = 30.0
    body_read_timeout_s: float = 60.0
    timeout_keep_alive_s: float = 5.0
    # Connections (and in-flight requests) beyond this get 503; None: no limit.
    limit_concurrency: int | None = None
    # Output streams (prompts x n) one request may ask for.
    max_sequences_per_request: int = 256
    # /reset_prefix_cache, /sleep, /wake_up, /is_sleeping (vLLM's VLLM_SERVER_DEV_MODE=1).
    enable_dev_endpoints: bool = False
    # Threads that decode, check, render and tokenize request bodies.
    num_prepare_threads: int = 2
    # Tool calling (vLLM's flags): the parser that reads calls out of the model's text, and
    # whether tool_choice "auto" (the default when tools are given) is allowed.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # Whether tool_choice "none" leaves the tools out of the rendered prompt (vLLM's
    # --exclude-tools-when-tool-choice-none; by default the template still renders them).
    exclude_tools_when_tool_choice_none: bool = False
    # How the model's thinking is told from its answer (vLLM's --reasoning-parser: qwen3,
    # deepseek_r1); None: the output is all answer.
    reasoning_parser: str | None = None
    # Responses /v1/responses keeps in memory for previous_response_id, GET and cancel: the
    # least recently used goes first beyond this many; 0 stores none.
    max_stored_responses: int = 1000
    # Step the engine on a thread of this process (AsyncEngine) instead of in an engine-core
    # process of its own (AsyncMPEngine, the default).
    engine_in_process: bool = False

    def __post_init__(self) -> None:
        # A bad combination fails at start-up (ValueError), not on the first request.
        _ = self.tool_serving
        if self.max_stored_responses < 0:
            raise ValueError(
                f"max_stored_responses must be at least 0, got {self.max_stored_responses}."
            )
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)  # ValueError naming reasoning_parser

    @property
    def tool_serving(self) -> ToolServing:
        return ToolServing(
            self.tool_call_parser,
            self.enable_auto_tool_choice,
            self.exclude_tools_when_tool_choice_none,
        )


class AuthMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would buffer streams and hide disconnects).
    Several Authorization headers are a 400 (which one counts would be up to the server);
    with an API key, every path but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app: Any, api_key: str | tuple[str, ...] | None) -> None:
        self.app = app
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
        self.expected = [f"Bearer {key}".encode() for key in keys if key] or None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(given) > 1:
            response = JSONResponse(
                error_body(400, "The request has more than one Authorization header."),
                status_code=400,
            )
            await response(scope, receive, send)
            return
        if (
            self.expected is None
            or scope["path"] in OPEN_PATHS
            or scope["method"] == "OPTIONS"
            or any(hmac.compare_digest(given[0] if given else b"", key) for key in self.expected)
        ):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            error_body(401, "Incorrect or missing API key.", None, "invalid_api_key"),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


class RequestIdMiddleware:
    """Pure ASGI: every response carries X-Request-Id, the request's own or a new one (vLLM's
    --enable-request-id-headers)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [value for name, value in scope["headers"] if name == b"x-request-id"]
        request_id = given[0] if given else uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def serving_context(
    async_engine: AsyncEngine, config: ServerConfig, executor: Executor
) -> ServingContext:
    """What the completion and chat handlers know of the engine and the server's settings,
    preparing request bodies in `executor` (the server's app, and `octavo run-batch`)."""
    engine = async_engine.engine
    engine_config = engine.config
    return ServingContext(
        async_engine=async_engine,
        model_name=engine_config.served_model_name,
        model_names=engine_config.served_model_names or (engine_config.served_model_name,),
        max_logprobs=engine_config.max_logprobs,
        response_role=config.response_role,
        force_include_usage=config.enable_force_include_usage,
        default_chat_template_kwargs=config.default_chat_template_kwargs,
        trust_request_chat_template=config.trust_request_chat_template,
        return_tokens_as_token_ids=config.return_tokens_as_token_ids,
        sampling_defaults=engine_config.sampling_defaults,
        max_tokens_cap=engine_config.max_tokens_cap,
        max_model_len=engine_config.scheduler.max_model_len,
        vocab_size=engine.input_processor.vocab_size,
        max_request_body_bytes=config.max_request_body_bytes,
        executor=executor,
        body_read_timeout_s=config.body_read_timeout_s,
        max_sequences=config.max_sequences_per_request,
    )


def build_app(
    async_engine: AsyncEngine, config: ServerConfig, stat_logger: PrometheusStatLogger
) -> FastAPI:
    """The app over an AsyncEngine that its lifespan starts and shuts down."""
    engine = async_engine.engine
    engine_config = engine.config
    executor = ThreadPoolExecutor(config.num_prepare_threads, thread_name_prefix="octavo-prepare")
    context = serving_context(async_engine, config, executor)
    completions = OpenAIServingCompletion(context)
    chat = OpenAIServingChat(context, config.tool_serving, config.reasoning_parser)
    responses = OpenAIServingResponses(context, chat, config.max_stored_responses)
    messages = AnthropicServingMessages(context, chat)
    embeddings = OpenAIServingEmbedding(context)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="octavo",
        version=octavo.__version__,
        lifespan=lifespan,
        root_path=config.root_path,
        openapi_url=None if config.disable_fastapi_docs else "/openapi.json",
        docs_url=None if config.disable_fastapi_docs else "/docs",
        redoc_url=None if config.disable_fastapi_docs else "/redoc",
    )
    app.state.async_engine = async_engine
    # vLLM's HTTP series (http_requests_total, http_request_duration_seconds, ...), by the
    # instrumentator vLLM uses, in the registry /metrics renders.
    Instrumentator(
        excluded_handlers=list(UNMETERED_PATHS), registry=stat_logger.registry
    ).add().instrument(app)
    install_error_handlers(app)
    app.add_middleware(AuthMiddleware, api_key=config.api_key or None)
    if config.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )

    if engine_config.is_pooling:
        # A pooling model serves embeddings only; the generation endpoints answer 404, as
        # vLLM's (which does not route them for such a model).
        @app.post("/v1/embeddings")
        async def create_embedding(raw_request: Request) -> Response:
            return await embeddings.create(raw_request)

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        @app.post("/v1/responses")
        @app.post("/v1/messages")
        async def no_generation(raw_request: Request) -> Response:
            raise OpenAIError(
                404,
                f"The model does not support the {_api_name(raw_request)} API: it is served as "
                "a pooling model (--runner pooling); POST /v1/embeddings.",
            )
    else:

        @app.post("/v1/completions")
        async def create_completion(raw_request: Request) -> Response:
            return await completions.create(raw_request)

        @app.post("/v1/chat/completions")
        async def create_chat_completion(raw_request: Request) -> Response:
            return await chat.create(raw_request)

        @app.post("/v1/responses")
        async def create_response(raw_request: Request) -> Response:
            return await responses.create(raw_request)

        @app.get("/v1/responses/{response_id}")
        async def retrieve_response(response_id: str, raw_request: Request) -> Response:
            query = raw_request.query_params
            return responses.retrieve(response_id, query.get("stream"), query.get("starting_after"))

        @app.post("/v1/responses/{response_id}/cancel")
        async def cancel_response(response_id: str) -> Response:
            return await responses.cancel(response_id)

        @app.post("/v1/messages")
        async def create_message(raw_request: Request) -> Response:
            return await messages.create(raw_request)

        @app.post("/v1/messages/count_tokens")
        async def count_message_tokens(raw_request: Request) -> Response:
            return await messages.count_tokens(raw_request)

        @app.post("/v1/embeddings")
        async def no_embeddings() -> Response:
            raise OpenAIError(
                404,
                "The model does not support the Embeddings API: it is served as a generation "
                "model; serve an embedding model, or this one with --runner pooling "
                "(--convert embed).",
            )

    # vLLM's other pooling endpoints: octavo has no classification, scoring or reranking head.
    @app.post("/pooling")
    @app.post("/classify")
    @app.post("/score")
    @app.post("/v1/score")
    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @app.post("/v2/embed")
    async def no_other_pooling(raw_request: Request) -> Response:
        raise OpenAIError(
            404,
            f"{raw_request.url.path} is not supported by octavo: of vLLM's pooling endpoints "
            "it serves /v1/embeddings only.",
        )

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [
            ModelCard(id=name, root=engine_config.model, max_model_len=context.max_model_len)
            for name in context.model_names
        ]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> JSONResponse:
        body = await read_body(
            raw_request, config.max_request_body_bytes, config.body_read_timeout_s
        )
        return JSONResponse(await prepare(context, _tokenize, body))

    def _tokenize(body: bytes) -> dict[str, Any]:
        request = parse_body(body, TokenizeRequest)
        check_model(context, request.model)
        processor = engine.input_processor
        try:
            if request.messages is not None:
                # Rendered exactly as a chat completion renders the same fields, so `count`
                # is that request's prompt_tokens.
                render = chat_render_from(request, check_tools(request.tools), context)
                processed = render(processor)
            elif request.prompt is not None:
                add_special = request.add_special_tokens is not False
                processed = processor.process_prompt(request.prompt, add_special)
            else:
                raise bad_request("Give prompt or messages.", "prompt")
        except ValueError as exc:
            raise from_value_error(exc, {"prompt", "messages"}, {}) from None
        tokens = processed.prompt_token_ids
        return {"count": len(tokens), "max_model_len": context.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> JSONResponse:
        body = await read_body(
            raw_request, config.max_request_body_bytes, config.body_read_timeout_s
        )
        return JSONResponse(await prepare(context, _detokenize, body))

    def _detokenize(body: bytes) -> dict[str, Any]:
        request = parse_body(body, DetokenizeRequest)
        check_model(context, request.model)
        bad = [t for t in request.tokens if not 0 <= t < context.vocab_size]
        if bad:
            raise bad_request(
                f"tokens: id {bad[0]} is out of range for vocab_size {context.vocab_size}.",
                "tokens",
            )
        return {"prompt": engine.tokenizer.decode(request.tokens)}

    if config.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> JSONResponse:
            return JSONResponse(tokenizer_info(engine.tokenizer, engine_config.chat_template))

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            raise OpenAIError(503, f"The engine is not running: {async_engine.dead_reason}")
        return Response(status_code=200)

    # Two routes, so that each method has its own OpenAPI operation id.
    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """SageMaker's health check."""
        return await health()

    @app.post("/invocations")
    async def invocations(raw_request: Request) -> Response:
        """SageMaker's one endpoint: a chat completion for a body with `messages`, else a
        completion for one with `prompt`."""
        body = await read_body(
            raw_request, config.max_request_body_bytes, config.body_read_timeout_s
        )
        fields = await prepare(context, _top_level_keys, body)  # off the event loop
        replay = _replayed(raw_request, body)
        if "messages" in fields:
            return await chat.create(replay)
        if "prompt" in fields:
            return await completions.create(replay)
        raise bad_request(
            "/invocations takes a chat body (messages) or a completion body (prompt).", "messages"
        )

    @app.post("/v1/load_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def lora_adapters() -> Response:
        raise OpenAIError(
            404, "This server serves no LoRA adapters: octavo does not implement them."
        )

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": octavo.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=stat_logger.content_type)

    add_ops_routes(app, async_engine)

    if config.enable_dev_endpoints:

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> JSONResponse:
            reset = await async_engine.call(lambda e: e.reset_prefix_cache())
            return JSONResponse({"success": bool(reset)})

        _add_sleep_routes(app, async_engine)

    if engine.config.profiler_config:

        @app.post("/start_profile")
        async def start_profile() -> Response:
            await async_engine.call(lambda e: e.start_profile())
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            await async_engine.call(lambda e: e.stop_profile())
            return Response(status_code=200)

    return app


def _api_name(raw_request: Request) -> str:
    path = raw_request.url.path
    for suffix, name in (
        ("chat/completions", "Chat Completions"),
        ("/responses", "Responses"),
        ("/messages", "Messages"),
    ):
        if path.endswith(suffix):
            return name
    return "Completions"


def _add_sleep_routes(app: FastAPI, async_engine: AsyncEngine) -> None:
    """vLLM's dev-mode sleep endpoints: POST /sleep?level=N&mode=abort, POST
    /wake_up?tags=weights&tags=kv_cache (none: all), GET /is_sleeping. Requests that arrive
    while the engine sleeps wait for its wake-up."""

    @app.post("/sleep")
    async def sleep(raw_request: Request) -> Response:
        level_text = raw_request.query_params.get("level", "1")
        mode = raw_request.query_params.get("mode", "abort")
        try:
            level = int(level_text)
        except ValueError:
            raise bad_request(f"level must be 0, 1 or 2; got {level_text!r}.", "level") from None
        enabled = async_engine.engine.config.enable_sleep_mode
        try:
            check_sleep(level, mode, enabled)
        except ValueError as exc:
            param = "mode" if enabled and level in SLEEP_LEVELS else "level"
            raise bad_request(str(exc), param) from None
        await async_engine.call(lambda e: e.sleep(level, mode))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(raw_request: Request) -> Response:
        tags = raw_request.query_params.getlist("tags") or None
        try:
            check_wake_up_tags(tags)
        except ValueError as exc:
            raise bad_request(str(exc), "tags") from None
        await async_engine.call(lambda e: e.wake_up(tags))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        asleep = await async_engine.call(lambda e: e.is_sleeping())
        return JSONResponse({"is_sleeping": bool(asleep)})


def _top_level_keys(body: bytes) -> set[str]:
    """The keys of a JSON object body (nothing for anything else: the endpoint it goes to
    reports what is wrong with it)."""
    try:
        value = json.loads(body)
    except ValueError:
        return set()
    return set(value) if isinstance(value, dict) else set()


def _replayed(raw_request: Request, body: bytes) -> Request:
    """`raw_request` whose body, already read, is given again to the endpoint that reads it;
    what the client sends after it (a disconnect) still reaches that endpoint."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await raw_request.receive()

    return Request(raw_request.scope, receive)


def make_server_app(engine: LLMEngine | AsyncEngine, config: ServerConfig) -> FastAPI:
    """An app over a loaded engine (or one already on its thread, from
    `AsyncEngine.from_factory`), with Prometheus stats recorded on every step (by the engine,
    on its thread)."""
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    engine = async_engine.engine
    stat_logger = stat_logger_for(engine.config, engine.num_replicas)
    engine.add_stat_logger(stat_logger)
    async_engine.queue_limits.on_reject = stat_logger.record_admission_rejection
    return build_app(async_engine, config, stat_logger)


def run_server(engine_args: EngineArgs, config: ServerConfig) -> int:
    """Start the engine core (its own process unless `config.engine_in_process`), serve until
    SIGTERM or Ctrl-C and shut down gracefully (0), or until the engine-core process dies (1:
    its requests fail, /health answers 503 while the server closes)."""
    from octavo.entrypoints.server.http_server import make_server

    if engine_args.distributed_executor_backend == "external_launcher":
        raise ValueError(
            "distributed_executor_backend='external_launcher' is for the offline LLM in "
            "processes torchrun starts; octavo serve starts its ranks itself (mp or ray)."
        )
    if config.engine_in_process:
        # Built on the thread that will step it: one OpenMP team for all of its torch work.
        async_engine = AsyncEngine.from_factory(lambda: LLMEngine.from_engine_args(engine_args))
    else:
        async_engine = AsyncMPEngine.from_engine_args(engine_args)
    app = make_server_app(async_engine, config)
    server = make_server(app, async_engine, config)
    engine_died: list[str] = []
    if isinstance(async_engine, AsyncMPEngine):

        def stop_serving(reason: str) -> None:
            engine_died.append(reason)
            server.should_exit = True  # uvicorn's loop reads it every 0.1 s

        async_engine.on_dead(stop_serving)
    # uvicorn re-raises the signal it caught once it has shut down; with this handler in
    # place that re-raise is a no-op and the process exits 0 after a graceful stop.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if engine_died:
        logger.error("server stopped: %s", engine_died[0])
        return 1
    logger.info("server stopped")
    return 0
