"""Terminal front ends: `octavo generate` (one prompt) and `octavo chat` (interactive).

Both stream text to stdout as the engine produces it, through the same LLMEngine step loop
the offline API uses.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, TextIO

from octavo.config import EngineArgs
from octavo.core.sampling_params import SamplingParams
from octavo.engine.input_processor import ProcessedPrompt
from octavo.engine.llm_engine import LLMEngine
from octavo.engine.output_processor import OutputKind


def stream_text(
    engine: LLMEngine, prompt: str | ProcessedPrompt, params: SamplingParams
) -> Iterator[tuple[str, str | None]]:
    """Yields (text delta, finish_reason or None) for one request until it finishes."""
    request_id = engine.next_request_id()
    engine.add_request(request_id, prompt, params, OutputKind.DELTA)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                completion = output.outputs[0]
                yield completion.text, completion.finish_reason
                if output.finished:
                    return
    finally:
        if engine.has_unfinished_requests():
            engine.abort_request(request_id)


def run_generate(args: EngineArgs, params: SamplingParams, prompt: str) -> int:
    engine = LLMEngine.from_engine_args(args)
    for delta, _ in stream_text(engine, prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def run_chat(
    args: EngineArgs,
    params: SamplingParams,
    system: str | None,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
) -> int:
    engine = LLMEngine.from_engine_args(args)
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    stdout.write("octavo chat: type a message, Ctrl-D or /exit to quit.\n")
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            stdout.write("\n")
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        try:
            prompt = engine.input_processor.render_chat(messages)
        except ValueError as exc:
            messages.pop()
            stdout.write(f"[{exc}]\n")
            continue
        reply = []
        try:
            for delta, _ in stream_text(engine, prompt, params):
                reply.append(delta)
                stdout.write(delta)
                stdout.flush()
        except KeyboardInterrupt:
            stdout.write(" [interrupted]")
        stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
