"""The API server's side of the engine-core process: MPEngine starts the process and talks to
it; AsyncMPEngine streams its outputs to asyncio with AsyncEngine's interface.

    API server process                                engine-core process (core_proc.py)
    prepare threads: render, tokenize, check
    event loop: generate() -> fan_out -> "add"  ---->  read commands
                                                       schedule -> execute -> update
    output thread: detokenize, stop strings    <----  "step" (outputs + stats), one per step
        -> RequestOutputs to each stream
        -> "abort" (stopped) for stop strings  ---->

The output processor (text, stop strings, n > 1 folding) and the stat loggers live here, so the
core steps while this process detokenizes and serves HTTP. One lock guards the output
processor, the streams and the input socket: the event loop adds and aborts under it, the
output thread processes each step's outputs under it.

If the core process dies, every request in flight fails with EngineDeadError, `is_running`
turns False (/health answers 503) and the `on_dead` callbacks run (the server exits non-zero).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from octavo.config import EngineArgs
from octavo.core.sampling_params import SamplingParams
from octavo.engine import serial
from octavo.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    _Abort,
    _Add,
    _Call,
    _EndAll,
    run_call,
)
from octavo.engine.core_proc import CoreInfo, run_engine_core
from octavo.engine.input_processor import InputProcessor
from octavo.engine.llm_engine import fan_out, record_stats
from octavo.engine.output_processor import OutputKind, OutputProcessor
from octavo.metrics.request_log import RequestLogWriter
from octavo.metrics.stats import SchedulerStats, StatLogger
from octavo.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long the frontend waits for the core to load its model and report ready.
STARTUP_TIMEOUT_S = 1800.0
# How often the output thread, with no message, checks that the core process is alive.
_POLL_MS = 100


class MPEngine:
    """The frontend of one engine-core process, with the parts of LLMEngine's interface the
    server uses (config, tokenizer, input processor, stat loggers, utility calls)."""

    def __init__(self, args: EngineArgs) -> None:
        self._dir = tempfile.mkdtemp(prefix="octavo-")
        input_address = f"ipc://{os.path.join(self._dir, 'input')}"
        output_address = f"ipc://{os.path.join(self._dir, 'output')}"
        self._context = zmq.Context()
        # The sending sides connect: a connecting socket queues messages from the first one
        # (a binding one has no peer until the handshake is done, and refuses them), and it
        # keeps queueing, never blocking, after the peer has gone (the process watch then
        # reports the death). No high-water mark: nothing is ever dropped.
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.connect(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        spawn = multiprocessing.get_context("spawn")
        self._conn, child_conn = spawn.Pipe()
        self.process = spawn.Process(
            target=run_engine_core,
            args=(args, input_address, output_address, child_conn),
            name="octavo-engine-core",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        try:
            info = self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.config = info.config
        self.sampling_defaults = dict(info.sampling_defaults)
        # Imported here: the tokenizer library's import is the frontend's alone.
        from octavo.engine.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.config.model, self.config.chat_template)
        # Validation only (the core compiles its own grammars for the steps).
        structured = StructuredOutputManager(self.tokenizer, info.vocab_size, info.eos_token_ids)
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.config.scheduler.max_model_len,
            info.vocab_size,
            info.eos_token_ids,
            structured,
            self.config.max_logprobs,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers: list[StatLogger] = []
        if self.config.request_log is not None:
            self.stat_loggers.append(RequestLogWriter(self.config.request_log))
        self.lock = threading.RLock()
        self._call_ids = itertools.count()
        self._calls: dict[int, concurrent.futures.Future] = {}

    def _wait_ready(self) -> CoreInfo:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._conn.poll(0.5):
            if not self.process.is_alive():
                raise RuntimeError(
                    f"The engine-core process exited (code {self.process.exitcode}) before it "
                    "was ready; its log above says why."
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"The engine core was not ready in {STARTUP_TIMEOUT_S:g} s.")
        kind, payload = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"The engine core failed to start:\n{payload}")
        return payload

    # --- LLMEngine's interface, for the server ----------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling_defaults)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Hand every later step's stats to `stat_logger` (on the output thread)."""
        self.stat_loggers.append(stat_logger)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        with self.lock:
            core_ids = self.output_processor.abort_requests(request_ids)
            if core_ids:
                try:
                    self.send(["abort", core_ids, False])
                except EngineDeadError:
                    pass  # nothing left to abort there

    def has_unfinished_requests(self) -> bool:
        """Requests whose final output is not out, here or in the core."""
        with self.lock:
            if self.output_processor.has_unfinished_requests():
                return True
        return bool(self.call_utility("has_unfinished_requests"))

    def get_num_unfinished_requests(self) -> int:
        with self.lock:
            return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))

    def make_stats(self) -> SchedulerStats:
        return serial.decode_scheduler_stats(self.call_utility("make_stats"))

    def check_integrity(self) -> None:
        self.call_utility("check_integrity")

    # --- the boundary -----------------------------------------------------------------------------

    def send(self, message: list[Any]) -> None:
        """Never blocks (see the sockets in __init__); EngineDeadError if refused all the same."""
        with self.lock:
            try:
                self._input.send(serial.pack(message), zmq.NOBLOCK)
            except zmq.Again:
                raise EngineDeadError("The engine is not running: its process has gone.") from None

    def call_utility(self, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        """Run `core.<method>(*args)` in the core process between two of its steps; from any
        thread but the output thread (which delivers the answer)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = future
            try:
                self.send(["utility", call_id, method, list(args)])
            except EngineDeadError:
                del self._calls[call_id]
                raise
        return future.result(timeout_s)

    def resolve_call(self, call_id: int, ok: bool, result: Any) -> None:
        with self.lock:
            future = self._calls.pop(call_id, None)
        if future is None:
            return
        if ok:
            future.set_result(result)
        else:
            future.set_exception(RuntimeError(f"The engine core's call failed: {result}"))

    def fail_calls(self, error: BaseException) -> None:
        with self.lock:
            calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_exception(error)

    def receive(self, timeout_ms: int) -> list[Any] | None:
        """The core's next message, or None after `timeout_ms` (the output thread only)."""
        if not self._output.poll(timeout_ms):
            return None
        return serial.unpack(self._output.recv())

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the core (after a "shutdown" it exits on its own), release the sockets."""
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        self._conn.close()
        self._input.close()
        self._output.close()
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class AsyncMPEngine(AsyncEngine):
    """AsyncEngine's interface over an engine-core process. Commands take effect at once, on
    the caller's thread (under the engine's lock), instead of waiting for a step loop here:
    the step loop is the core's."""

    engine: MPEngine  # type: ignore[assignment]

    def __init__(self, engine: MPEngine) -> None:
        super().__init__(engine)  # type: ignore[arg-type]
        self._on_dead: list[Callable[[str], None]] = []
        # Set once the core was told to stop: its exit is then no death.
        self._closing = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncMPEngine:
        """Start the engine-core process and wait until its model is loaded."""
        return cls(MPEngine(args))

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` (on the output thread) if the core process dies."""
        self._on_dead.append(callback)

    @property
    def is_running(self) -> bool:
        return super().is_running and self.engine.process.is_alive()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is in flight (callers get their final outputs), stop the core
        process and the output thread. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self.engine.process.is_alive():
            self.engine.abort_request(list(self._streams))
            try:
                self.engine.send(["shutdown"])
            except EngineDeadError:
                pass
            self.engine.process.join(timeout_s)
        super().shutdown(timeout_s)
        self.engine.close(timeout_s)
        with self.engine.lock:
            self._fail_streams(EngineDeadError("The engine stopped."))
        if self._dead_reason is None:
            self._dead_reason = "shut down"

    # --- commands, applied on the caller's thread -------------------------------------------------

    def _submit(self, command: _Add | _Abort | _Call | _EndAll) -> None:
        engine = self.engine
        if isinstance(command, _Call):
            threading.Thread(target=run_call, args=(command, engine), daemon=True).start()
            return
        with engine.lock:
            if isinstance(command, _Abort):
                engine.abort_request(command.request_ids)
            elif isinstance(command, _EndAll):
                self._fail_all(EngineDeadError(command.reason))
            else:
                self._add_now(command)

    def _add_now(self, command: _Add) -> None:
        engine = self.engine
        core_requests = []
        added: list[str] = []
        try:
            for request in command.requests:
                core_requests += fan_out(
                    engine.input_processor,
                    engine.output_processor,
                    request.request_id,
                    request.prompt,
                    request.sampling_params,
                    OutputKind.DELTA,
                    request.arrival_time,
                )
                added.append(request.request_id)
            engine.send(["add", [serial.encode_request(r) for r in core_requests]])
        except Exception as exc:
            # All or nothing: one rejected prompt rejects the call.
            engine.output_processor.abort_requests(added)
            # Forgets those; other requests' aborts flushed with them go to their streams.
            self._deliver(engine.output_processor.process_outputs([]).request_outputs)
            self._send(command.stream, [exc])
            return
        for request in command.requests:
            self._streams[request.request_id] = command.stream

    # --- the output thread ------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                message = engine.receive(_POLL_MS)
                if message is None:
                    if self._closing:
                        continue
                    if not engine.process.is_alive():
                        self._died(
                            f"the engine-core process exited (code {engine.process.exitcode})"
                        )
                        return
                    continue
                self._handle(message)
        except BaseException as exc:  # a bug in this loop: nobody may be left waiting
            logger.exception("the engine's output thread crashed")
            self._died(f"the engine's output thread crashed: {exc!r}")
            raise

    def _handle(self, message: list[Any]) -> None:
        engine = self.engine
        kind = message[0]
        if kind == "step":
            _, outputs, iteration, scheduler = message
            with engine.lock:
                processed = engine.output_processor.process_outputs(
                    [serial.decode_output(item) for item in outputs]
                )
                # The one backward edge: stop strings found in the text end those requests.
                if processed.reqs_to_abort:
                    try:
                        engine.send(["abort", processed.reqs_to_abort, True])
                    except EngineDeadError:
                        pass  # the next poll finds the process gone
                self._deliver(processed.request_outputs)
            self._num_steps += 1
            record_stats(
                self.engine.stat_loggers,
                serial.decode_scheduler_stats(scheduler),
                serial.decode_iteration_stats(iteration),
            )
        elif kind == "utility":
            engine.resolve_call(*message[1:])
        elif kind == "failed":
            logger.error("the engine core's step failed: %s", message[1])
            with engine.lock:
                self._fail_all(
                    EngineStepError(f"The engine failed while running this request: {message[1]}")
                )
        else:
            logger.error("unknown message %r from the engine core", kind)

    def _died(self, reason: str) -> None:
        logger.error("%s: failing every request in flight", reason)
        self._dead_reason = reason
        error = EngineDeadError(f"The engine is not running: {reason}")
        with self.engine.lock:
            self._fail_streams(error)
        self.engine.fail_calls(error)
        for callback in self._on_dead:
            try:
                callback(reason)
            except Exception:
                logger.exception("on_dead callback %r failed", callback)
