"""AsyncEngine: runs the LLMEngine step loop on its own thread and streams outputs to asyncio.

Owns the engine thread, the command queue into it and the output queues out of it. The engine
thread is the only caller of LLMEngine: requests, aborts and calls reach it as commands that it
drains at the top of each iteration, and each step's outputs go back to the event loop with one
`loop.call_soon_threadsafe` per step. When there is nothing to run, the thread sleeps on a
condition variable (no busy spin); a new command wakes it.

`AsyncEngine.from_factory` also builds the engine on that thread, so that all of the engine's
torch work (loading, packing, every step) runs on one thread. Torch runs parallel regions on one
OpenMP thread team per calling thread, and GNU OpenMP stops letting a team's workers spin between
regions once its teams hold more threads than there are CPUs: every region then pays a thread
wake-up (~0.1 ms on a small VM, hundreds of regions per step). A model loaded on the main thread
and stepped on another decoded at half the speed of one stepped where it was loaded (measured:
benchmarks/history/, "Every core, one thread team").

Must not: tokenize, render templates or build HTTP responses (callers do that before submitting,
so the step loop never waits on them); block on a consumer (a slow reader only grows its own
queue); let an engine error leave a caller waiting (every in-flight request gets the error).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from octavo.core.pooling_params import PoolingParams
from octavo.core.request import FinishReason
from octavo.core.sampling_params import SamplingParams
from octavo.engine.input_processor import ProcessedPrompt
from octavo.engine.llm_engine import LLMEngine
from octavo.engine.output_processor import OutputKind
from octavo.engine.outputs import PoolingRequestOutput, RequestOutput
from octavo.engine.queue_limits import QueueLimits
from octavo.engine.step_rates import StepRates, StepShape

logger = logging.getLogger(__name__)

T = TypeVar("T")

# After this many failed steps in a row the engine is declared dead: each failure already
# failed and aborted every in-flight request, so a repeat means the engine itself is broken.
_MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or broken by repeated step failures)."""


class EngineStepError(RuntimeError):
    """A step raised; every request that was in flight fails with this error."""


class EngineRequestError(RuntimeError):
    """The engine could not run one request of the call (its preparation or its sampling
    raised; FinishReason.ERROR); the other requests in the engine ran on."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One prompt to run, already tokenized and checked by the caller."""

    request_id: str
    prompt: ProcessedPrompt
    # PoolingParams: a pooling request (one PoolingRequestOutput when it ends).
    sampling_params: SamplingParams | PoolingParams
    arrival_time: float
    # vLLM's: lower runs earlier under the priority scheduling policy.
    priority: int = 0
    # What its outputs carry; the server streams deltas.
    output_kind: OutputKind = OutputKind.DELTA

    @property
    def num_streams(self) -> int:
        """Output streams it runs (n; a pooling request has one)."""
        params = self.sampling_params
        return params.n if isinstance(params, SamplingParams) else 1


def request_errors(output: RequestOutput | PoolingRequestOutput) -> list[str]:
    """Why the engine could not run (parts of) a request: FinishReason.ERROR's messages."""
    if isinstance(output, PoolingRequestOutput):
        return [output.error or ""] if output.finish_reason == FinishReason.ERROR else []
    return [c.error or "" for c in output.outputs if c.finish_reason == FinishReason.ERROR]


class _OutputStream:
    """The asyncio side of one `generate` call: a queue the engine thread fills via the loop."""

    __slots__ = ("num_unfinished", "queue")

    def __init__(self, num_requests: int) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.num_unfinished = num_requests


@dataclass(slots=True)
class _Add:
    requests: Sequence[EngineRequest]
    stream: _OutputStream


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


@dataclass(slots=True)
class _EndAll:
    reason: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        """Over an engine built by the caller (on any thread; prefer `from_factory`). Stats reach
        their loggers through `engine.add_stat_logger`, on the engine thread."""
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _Call | _EndAll] = []
        self._stopping = False
        self._dead_reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Engine-thread state: request id -> the stream its outputs go to.
        self._streams: dict[str, _OutputStream] = {}
        self._num_steps = 0
        # The engine's measured step rates (recorded with each step's stats), for the
        # predicted wait of --max-queue-wait and for /v1/kv.
        scheduler = engine.config.scheduler
        self.step_rates = StepRates(
            StepShape(
                scheduler.max_num_batched_tokens,
                scheduler.long_prefill_token_threshold,
                engine.num_replicas,
            )
        )
        engine.add_stat_logger(self.step_rates)
        # Event-loop state: --max-num-queued-reqs / --max-num-queued-tokens and their tallies,
        # --max-queue-wait.
        self.queue_limits = QueueLimits(
            scheduler.max_num_queued_reqs,
            scheduler.max_num_queued_tokens,
            max_queue_wait_s=scheduler.max_queue_wait_s,
            step_rates=self.step_rates,
        )

    @classmethod
    def from_factory(cls, make_engine: Callable[[], LLMEngine]) -> AsyncEngine:
        """Start the engine thread, build the engine there with `make_engine()`, and return once
        it is built; the thread then waits for `start` to begin stepping. Re-raises whatever
        the build raised (the thread has ended then)."""
        built = threading.Event()
        failure: list[BaseException] = []
        holder: list[AsyncEngine] = []

        def thread_main() -> None:
            try:
                engine = make_engine()
            except BaseException as exc:
                failure.append(exc)
                built.set()
                return
            holder.append(cls(engine))
            holder[0]._thread = threading.current_thread()
            built.set()
            holder[0]._wait_for_loop_then_run()

        thread = threading.Thread(target=thread_main, name="octavo-engine", daemon=True)
        thread.start()
        built.wait()
        if failure:
            thread.join()
            raise failure[0]
        return holder[0]

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start stepping; outputs are delivered on `loop` (default: the running one). Once
        started, only a loop that has been closed is replaced (nobody listens there any more):
        a script may run the engine under one `asyncio.run` after another."""
        if self._loop is not None and not self._loop.is_closed():
            return
        with self._cond:
            self._loop = loop or asyncio.get_running_loop()
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="octavo-engine", daemon=True)
            self._thread.start()

    def _wait_for_loop_then_run(self) -> None:
        with self._cond:
            while self._loop is None and not self._stopping:
                self._cond.wait()
        self._run()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is in flight (callers get their final "abort" outputs), stop the
        thread and wait for it. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop outputs are delivered on (set by `start`)."""
        return self._loop

    @property
    def num_steps(self) -> int:
        """Steps run so far (tests use it to check the thread sleeps when idle)."""
        return self._num_steps

    # --- the asyncio side ---------------------------------------------------------------------

    async def generate(self, requests: Sequence[EngineRequest]) -> AsyncIterator[RequestOutput]:
        """Run `requests` and yield their RequestOutputs (each request's `output_kind`) as
        steps produce them, until all have finished. Closing the iterator early (a
        disconnect, a cancelled task) aborts the unfinished ones within one step.

        Raises QueueOverflowError if the queue bounds (`queue_limits`) leave no room for the
        call, ValueError if the engine rejected a request (nothing of the call runs then),
        EngineRequestError if one of them ended with FinishReason.ERROR (the rest of the call is
        aborted), EngineStepError if a step failed, EngineDeadError if the engine is stopped.
        """
        self._check_alive()
        # Per request: the slots it holds in the queue bounds (n), and its prompt tokens until
        # its first output says the prompt is done.
        num_slots = {r.request_id: r.num_streams for r in requests}
        prefilling = {r.request_id: len(r.prompt.prompt_token_ids) for r in requests}
        self.queue_limits.admit(sum(num_slots.values()), sum(prefilling.values()))
        stream = _OutputStream(len(requests))
        request_ids = [r.request_id for r in requests]
        finished: set[str] = set()
        try:
            self._submit(_Add(requests, stream))
            while len(finished) < len(request_ids):
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                for error in request_errors(item):
                    raise EngineRequestError(f"The engine could not run this request: {error}")
                if item.request_id in prefilling:
                    self.queue_limits.prefilled(prefilling.pop(item.request_id))
                if item.finished:
                    finished.add(item.request_id)
                    self.queue_limits.finished(num_slots.pop(item.request_id))
                yield item
        finally:
            self.queue_limits.prefilled(sum(prefilling.values()))
            self.queue_limits.finished(sum(num_slots.values()))
            unfinished = [r for r in request_ids if r not in finished]
            if unfinished:
                self.abort(unfinished)

    def check_admission(self, requests: Sequence[EngineRequest]) -> None:
        """Raise QueueOverflowError if `generate(requests)` would be rejected now by the queue
        bounds (a server checks before it starts a stream, so that the rejection is an HTTP
        status, not an error event; generate checks again, and that one holds)."""
        self.queue_limits.check(
            sum(r.num_streams for r in requests),
            sum(len(r.prompt.prompt_token_ids) for r in requests),
        )

    def abort(self, request_ids: str | list[str]) -> None:
        """Thread-safe; takes effect at the top of the next engine iteration."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self._submit(_Abort(list(request_ids)))

    def end_all(self, reason: str) -> None:
        """Thread-safe: end every request in flight now, each of their callers getting
        EngineDeadError(reason) (a server shutting down ends its streams this way, so that
        each closes with an error event instead of being cut). The engine keeps running."""
        self._submit(_EndAll(reason))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def _check_alive(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(f"The engine is not running: {self._dead_reason}")
        if self._stopping:
            raise EngineDeadError("The engine is shutting down.")
        if self._loop is None:
            raise EngineDeadError("The engine has not been started.")

    def _submit(self, command: _Add | _Abort | _Call | _EndAll) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        has_work = False
        num_failures = 0
        try:
            while True:
                # 1) Drain commands; sleep first when there is nothing to step.
                commands, stopping = self._take_commands(wait=not has_work)
                for command in commands:
                    self._apply(command)
                if stopping:
                    break
                has_work = engine.has_unfinished_requests()
                if not has_work:
                    continue
                # 2) One step; 3) deliver its outputs.
                try:
                    outputs = engine.step()
                except Exception as exc:
                    num_failures += 1
                    logger.exception("engine step failed (%d in a row)", num_failures)
                    self._fail_all(_step_error(exc))
                    if num_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
                        self._dead_reason = f"{num_failures} engine steps failed in a row: {exc!r}"
                        break
                    continue
                num_failures = 0
                self._num_steps += 1
                self._deliver(outputs)
                # Asleep, a step only delivers aborts: requests added meanwhile wait for a
                # command (wake_up) instead of spinning the loop.
                has_work = engine.has_unfinished_requests() and not engine.is_sleeping()
        except BaseException as exc:  # a bug in this loop: nobody may be left waiting
            logger.exception("engine thread crashed")
            self._dead_reason = f"the engine thread crashed: {exc!r}"
            self._fail_all(_step_error(exc))
            raise
        finally:
            self._stop_in_flight()

    def _take_commands(self, wait: bool) -> tuple[list[_Add | _Abort | _Call | _EndAll], bool]:
        with self._cond:
            while wait and not self._commands and not self._stopping:
                self._cond.wait()
            commands, self._commands = self._commands, []
            return commands, self._stopping

    def _apply(self, command: _Add | _Abort | _Call | _EndAll) -> None:
        engine = self.engine
        if isinstance(command, _Abort):
            engine.abort_request(command.request_ids)
        elif isinstance(command, _EndAll):
            self._fail_all(EngineDeadError(command.reason))
        elif isinstance(command, _Call):
            run_call(command, engine)
        else:
            self._add(command)

    def _add(self, command: _Add) -> None:
        added: list[str] = []
        try:
            for request in command.requests:
                self.engine.add_request(
                    request.request_id,
                    request.prompt,
                    request.sampling_params,
                    request.output_kind,
                    request.arrival_time,
                    request.priority,
                )
                added.append(request.request_id)
        except Exception as exc:
            # All or nothing: one rejected prompt rejects the call.
            self.engine.abort_request(added)
            self._send(command.stream, [exc])
            return
        for request in command.requests:
            self._streams[request.request_id] = command.stream

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batches: dict[int, tuple[_OutputStream, list[RequestOutput | BaseException]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # its caller has gone (aborted after a disconnect)
            if output.finished:
                del self._streams[output.request_id]
            batches.setdefault(id(stream), (stream, []))[1].append(output)
        for stream, items in batches.values():
            self._send(stream, items)

    def _send(self, stream: _OutputStream, items: list[RequestOutput | BaseException]) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(_put_all, stream.queue, items)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def _fail_streams(
        self, error: BaseException, request_ids: list[str] | None = None
    ) -> list[str]:
        """Send `error` to every stream in flight (or to those of `request_ids`) and forget
        them; returns the request ids failed."""
        if request_ids is None:
            request_ids = list(self._streams)
        else:
            request_ids = [r for r in request_ids if r in self._streams]
        streams = {}
        for request_id in request_ids:
            stream = self._streams.pop(request_id)
            streams[id(stream)] = stream
        for stream in streams.values():
            self._send(stream, [error])
        return request_ids

    def _fail_all(self, error: BaseException) -> None:
        """Fail every in-flight request with `error` and free its blocks."""
        request_ids = self._fail_streams(error)
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            logger.exception("aborting the failed requests failed too")

    def _stop_in_flight(self) -> None:
        """On shutdown: abort everything and flush the final "abort" outputs to callers."""
        engine = self.engine
        for command in self._take_commands(wait=False)[0]:
            if isinstance(command, _Add):
                self._send(command.stream, [EngineDeadError("The engine is shutting down.")])
            elif isinstance(command, _Call):
                command.future.set_exception(EngineDeadError("The engine is shutting down."))
        try:
            engine.abort_request(list(self._streams))
            deadline = time.monotonic() + 5.0
            while engine.has_unfinished_requests() and time.monotonic() < deadline:
                self._deliver(engine.step())
        except Exception:
            logger.exception("flushing aborted requests at shutdown failed")
        self._fail_streams(EngineDeadError("The engine stopped."))
        if self._dead_reason is None:
            self._dead_reason = "shut down"


def run_call(command: _Call, engine: Any) -> None:
    """`command.fn(engine)`, its result or exception in `command.future`."""
    try:
        command.future.set_result(command.fn(engine))
    except Exception as exc:
        command.future.set_exception(exc)


def _step_error(exc: BaseException) -> EngineStepError:
    return EngineStepError(f"The engine failed while running this request: {exc!r}")


def _put_all(queue: asyncio.Queue, items: list[RequestOutput | BaseException]) -> None:
    for item in items:
        queue.put_nowait(item)
