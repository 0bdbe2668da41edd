"""`octavo run-batch -i requests.jsonl -o results.jsonl`: a file of requests in OpenAI's batch
format, answered by the server's own serving code in this process, without HTTP.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with url
/v1/chat/completions or /v1/completions (a generation model), or /v1/embeddings (a pooling
model; the other answers 404, as the server does); each output line, in input order, is `{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}` (vLLM's run-batch
shapes). A line that fails (not JSON, another url or method, a body the endpoint refuses) gets
the status the server would answer with, a null body and the server's error object under
`error`; it never stops the file. Requests run concurrently, at most twice max_num_seqs at a
time, through OpenAIServingChat, OpenAIServingCompletion and OpenAIServingEmbedding, so
validation, defaults, tool calls and structured outputs are those of `octavo serve`.

Must not: step the engine (the engine-core process or the AsyncEngine thread does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

from tqdm import tqdm

from octavo.config import EngineArgs
from octavo.engine.async_engine import AsyncEngine
from octavo.engine.core_client import AsyncMPEngine
from octavo.engine.llm_engine import LLMEngine
from octavo.entrypoints.server.app import ServerConfig, serving_context
from octavo.entrypoints.server.errors import OpenAIError, bad_request, error_body
from octavo.entrypoints.server.serving_chat import OpenAIServingChat
from octavo.entrypoints.server.serving_completion import OpenAIServingCompletion
from octavo.entrypoints.server.serving_embedding import OpenAIServingEmbedding

logger = logging.getLogger(__name__)

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
# Endpoints vLLM's run-batch takes that octavo does not serve (no scoring or reranking head).
POOLING_URLS = ("/score", "/rerank", "/v1/score", "/v1/rerank")


@dataclass(frozen=True)
class LineResult:
    """One output line: the response body, or the error the server would answer with."""

    custom_id: str | None
    status_code: int
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": f"vllm-{uuid.uuid4().hex}",
                "custom_id": self.custom_id,
                "response": {
                    "status_code": self.status_code,
                    "request_id": f"vllm-batch-{uuid.uuid4().hex}",
                    "body": self.body,
                },
                "error": self.error,
            },
            ensure_ascii=False,
        )


def failed(custom_id: str | None, exc: OpenAIError) -> LineResult:
    return LineResult(
        custom_id,
        exc.status_code,
        error=error_body(exc.status_code, exc.message, exc.param, exc.code),
    )


@dataclass(frozen=True)
class ParsedLine:
    custom_id: str | None
    url: str = ""
    body: bytes = b""
    # Set when the line cannot be run at all.
    error: OpenAIError | None = None


def parse_line(line: str, number: int) -> ParsedLine:
    """An input line's custom_id, url and body (as JSON bytes, for the endpoint to parse as
    a request body), or the error it gets."""
    try:
        item = json.loads(line)
    except (ValueError, RecursionError) as exc:
        return ParsedLine(None, error=bad_request(f"Line {number} is not valid JSON: {exc}"))
    if not isinstance(item, dict):
        return ParsedLine(None, error=bad_request(f"Line {number} is not a JSON object."))
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str):
        message = f"Line {number}: custom_id must be a string."
        return ParsedLine(None, error=bad_request(message, "custom_id"))
    url = item.get("url")
    method = item.get("method", "POST")
    if url in POOLING_URLS:
        message = (
            f"Invalid URL (POST {url}): octavo serves no scoring or reranking models; "
            f"run-batch takes {', '.join(URLS)}."
        )
        return ParsedLine(custom_id, error=OpenAIError(404, message, "url"))
    if url not in URLS:
        message = f"Invalid URL (POST {url}): run-batch takes {', '.join(URLS)}."
        return ParsedLine(custom_id, error=OpenAIError(404, message, "url"))
    if method != "POST":
        message = f"Method {method} is not allowed for {url}."
        return ParsedLine(custom_id, error=OpenAIError(405, message, "method"))
    body = item.get("body")
    if not isinstance(body, dict):
        message = f"Line {number}: body must be a JSON object (the request's body)."
        return ParsedLine(custom_id, error=bad_request(message, "body"))
    return ParsedLine(custom_id, url, json.dumps(body).encode())


Endpoint = Callable[[bytes], Awaitable[Any]]


async def answer(parsed: ParsedLine, endpoints: dict[str, Endpoint]) -> LineResult:
    if parsed.error is not None:
        return failed(parsed.custom_id, parsed.error)
    try:
        response = await endpoints[parsed.url](parsed.body)
    except OpenAIError as exc:
        return failed(parsed.custom_id, exc)
    except Exception as exc:  # the server's answer to an unexpected error
        logger.exception("unhandled error in a batch request")
        return failed(parsed.custom_id, OpenAIError(500, f"Internal server error: {exc!r}"))
    return LineResult(parsed.custom_id, 200, body=response.model_dump(mode="json"))


def batch_endpoints(
    async_engine: AsyncEngine, config: ServerConfig, context: Any
) -> dict[str, Endpoint]:
    """url -> the server's handler of its body; what the model does not serve answers 404, as
    the server's routes do (a pooling model serves embeddings only, a generation model none)."""

    def unsupported(api: str, hint: str) -> Endpoint:
        async def refuse(_: bytes) -> Any:
            raise OpenAIError(404, f"The model does not support the {api} API: {hint}.", "url")

        return refuse

    if async_engine.engine.config.is_pooling:
        pooling = "it is served as a pooling model (--runner pooling)"
        return {
            CHAT_URL: unsupported("Chat Completions", pooling),
            COMPLETIONS_URL: unsupported("Completions", pooling),
            EMBEDDINGS_URL: OpenAIServingEmbedding(context).create_from_body,
        }
    return {
        CHAT_URL: OpenAIServingChat(
            context, config.tool_serving, config.reasoning_parser
        ).create_from_body,
        COMPLETIONS_URL: OpenAIServingCompletion(context).create_from_body,
        EMBEDDINGS_URL: unsupported(
            "Embeddings", "it is served as a generation model (--runner generate)"
        ),
    }


async def run_lines(
    async_engine: AsyncEngine,
    config: ServerConfig,
    lines: list[str],
    output: IO[str],
    progress: bool = True,
) -> int:
    """Answer every non-blank line of `lines` and write its result to `output`, in order;
    returns how many lines failed. Starts `async_engine` on the running loop and leaves
    shutting it down to the caller."""
    requests = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    executor = ThreadPoolExecutor(config.num_prepare_threads, thread_name_prefix="octavo-prepare")
    context = serving_context(async_engine, config, executor)
    endpoints = batch_endpoints(async_engine, config, context)
    async_engine.start()
    limit = asyncio.Semaphore(2 * async_engine.engine.config.scheduler.max_num_seqs)
    done: dict[int, LineResult] = {}
    next_to_write = 0
    num_failed = 0
    bar = tqdm(total=len(requests), unit="req", desc="Running batch", disable=not progress)

    async def run_one(index: int, number: int, line: str) -> None:
        nonlocal next_to_write, num_failed
        try:
            done[index] = await answer(parse_line(line, number), endpoints)
        finally:
            limit.release()
        bar.update()
        # Write every result that is next in input order.
        while next_to_write in done:
            result = done.pop(next_to_write)
            num_failed += result.error is not None
            output.write(result.to_json() + "\n")
            next_to_write += 1

    try:
        tasks = []
        for index, (number, line) in enumerate(requests):
            await limit.acquire()
            tasks.append(asyncio.create_task(run_one(index, number, line)))
        await asyncio.gather(*tasks)
    finally:
        bar.close()
        executor.shutdown(wait=False, cancel_futures=True)
    output.flush()
    return num_failed


def read_input(path: str) -> list[str]:
    """The lines of a local file, or of stdin for `-`."""
    check_local(path, "-i/--input-file")
    if path == "-":
        return sys.stdin.read().splitlines()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the input file: {exc}") from None


def open_output(path: str) -> contextlib.AbstractContextManager[IO[str]]:
    """The output file, opened now (an unwritable path fails before the model loads), or
    stdout for `-` (left open)."""
    if path == "-":
        return contextlib.nullcontext(sys.stdout)
    return open(path, "w", encoding="utf-8")


def check_local(path: str, flag: str) -> None:
    if path.startswith(("http://", "https://")):
        raise ValueError(
            f"{flag} {path}: octavo run-batch reads and writes local files (or - for "
            "stdin/stdout), not URLs; download or upload the file separately."
        )


async def run_and_shut_down(
    async_engine: AsyncEngine, config: ServerConfig, lines: list[str], output: IO[str]
) -> int:
    """run_lines, then the engine's shutdown while its loop still runs (as the server's
    lifespan does)."""
    try:
        return await run_lines(async_engine, config, lines, output)
    finally:
        await asyncio.to_thread(async_engine.shutdown)


def run_batch(
    engine_args: EngineArgs,
    config: ServerConfig,
    input_path: str,
    output_path: str,
) -> int:
    """Load the engine (in an engine-core process unless `config.engine_in_process`), answer
    the input file into the output file, shut down. 0 once the file is answered, whatever its
    lines' statuses (each is in the output)."""
    check_local(output_path, "-o/--output-file")
    lines = read_input(input_path)
    try:
        output = open_output(output_path)
    except OSError as exc:
        raise ValueError(f"cannot write the output file: {exc}") from None
    with output as out:
        if config.engine_in_process:
            async_engine = AsyncEngine.from_factory(lambda: LLMEngine.from_engine_args(engine_args))
        else:
            async_engine = AsyncMPEngine.from_engine_args(engine_args)
        num_failed = asyncio.run(run_and_shut_down(async_engine, config, lines, out))
    num_lines = sum(1 for line in lines if line.strip())
    logger.info("batch done: %d requests, %d failed", num_lines, num_failed)
    return 0
