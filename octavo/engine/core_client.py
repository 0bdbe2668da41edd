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

With `--data-parallel-size N` there are N engine-core processes, each with its own scheduler,
KV pool and share of the CPUs; each request goes to one of them (core/router.py: the replica
thought to hold the longest cached prefix of its prompt, unless that one is overloaded, else
the least loaded), and each step message says which replica it came from, so /metrics has a
series per engine.

If a core process dies, its requests in flight fail with EngineDeadError and the others serve
on; when none is left, `is_running` turns False (/health answers 503) and the `on_dead`
callbacks run (the server exits non-zero).
"""

from __future__ import annotations

import collections
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
from octavo.core.block_hash import extend_block_hashes
from octavo.core.pooling_params import PoolingParams
from octavo.core.router import PrefixRouter
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
from octavo.engine.core import EngineCoreRequest, check_sleep
from octavo.engine.core_proc import CoreInfo, run_engine_core
from octavo.engine.input_processor import InputProcessor
from octavo.engine.llm_engine import (
    add_finished_requests,
    fan_out,
    pooling_request,
    pooling_support,
    record_stats,
)
from octavo.engine.output_processor import OutputProcessor
from octavo.engine.outputs import RequestOutput
from octavo.metrics.request_log import RequestLogWriter
from octavo.metrics.spec_decode_log import SpecDecodingLogger
from octavo.metrics.stats import SchedulerStats, StatLogger
from octavo.structured_output import StructuredOutputManager
from octavo.worker.device import split_cpus

logger = logging.getLogger(__name__)

# How long the frontend waits for the core to load its model and report ready.
STARTUP_TIMEOUT_S = 1800.0
# How often the output thread, with no message, checks that the core process is alive.
_POLL_MS = 100
# Longest wait for a core's sleep or wake-up (a wake-up may load the weights again) and for
# a profiler trace to be written.
_SLOW_CALL_TIMEOUT_S = 1800.0


class _CoreProcess:
    """One engine-core process: the process, the pipe that ties its life to ours, and the two
    sockets to it."""

    def __init__(
        self,
        index: int,
        args: EngineArgs,
        context: zmq.Context,
        directory: str,
        cpus: list[int] | None,
    ) -> None:
        self.index = index
        input_address = f"ipc://{os.path.join(directory, f'input-{index}')}"
        output_address = f"ipc://{os.path.join(directory, f'output-{index}')}"
        # The sending sides connect: a connecting socket queues messages from the first one
        # (a binding one has no peer until the handshake is done, and refuses them), and it
        # keeps queueing, never blocking, after the peer has gone (the process watch then
        # reports the death). No high-water mark: nothing is ever dropped.
        self.input = context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.connect(input_address)
        self.output = context.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(output_address)
        spawn = multiprocessing.get_context("spawn")
        self.conn, child_conn = spawn.Pipe()
        self.process = spawn.Process(
            target=run_engine_core,
            args=(args, input_address, output_address, child_conn, index, cpus),
            name=f"octavo-engine-core-{index}",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        # Cleared once the frontend has seen this process die (or was told it stopped).
        self.live = True

    def wait_ready(self, deadline: float) -> CoreInfo:
        while not self.conn.poll(0.5):
            if not self.process.is_alive():
                raise RuntimeError(
                    f"The engine-core process {self.index} exited (code "
                    f"{self.process.exitcode}) before it was ready; its log above says why."
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"The engine core was not ready in {STARTUP_TIMEOUT_S:g} s.")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"The engine core {self.index} failed to start:\n{payload}")
        return payload

    def close(self, timeout_s: float) -> None:
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        self.conn.close()
        self.input.close()
        self.output.close()


class MPEngine:
    """The frontend of one or more engine-core processes (`data_parallel_size` replicas, each
    its own scheduler and KV pool), with the parts of LLMEngine's interface the server uses
    (config, tokenizer, input processor, stat loggers, utility calls). Each request goes to
    one replica, chosen by its cached prefix or load (PrefixRouter); its n > 1 children go
    with it, since they share its prompt's blocks."""

    def __init__(self, args: EngineArgs) -> None:
        self._dir = tempfile.mkdtemp(prefix="octavo-")
        self._context = zmq.Context()
        num_replicas = args.data_parallel_size
        self.cores: list[_CoreProcess] = []
        try:
            shares = split_cpus(num_replicas)
            if num_replicas > 1 and shares[0] is None:
                logger.warning(
                    "%d engine replicas on fewer CPUs: they share every CPU", num_replicas
                )
            for index, cpus in enumerate(shares):
                self.cores.append(_CoreProcess(index, args, self._context, self._dir, cpus))
            # They load their models side by side.
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            infos = [core.wait_ready(deadline) for core in self.cores]
        except BaseException:
            self.close()
            raise
        info = infos[0]
        self.config = info.config
        # Imported here: the tokenizer library's import is the frontend's alone.
        from octavo.engine.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.config.tokenizer_path, self.config.chat_template)
        # Validation only (the cores compile their own grammars for the steps).
        structured = StructuredOutputManager(
            self.tokenizer,
            info.vocab_size,
            info.eos_token_ids,
            reasoning_parser=self.config.reasoning_parser,
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.config.scheduler.max_model_len,
            info.vocab_size,
            info.eos_token_ids,
            structured,
            self.config.max_logprobs,
            self.config.scheduler.scheduling_policy,
            pooling_support(self.config),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers: list[StatLogger] = []
        if self.config.request_log is not None:
            self.stat_loggers.append(RequestLogWriter(self.config.request_log))
        if self.config.speculative is not None:
            self.stat_loggers.append(SpecDecodingLogger())
        self.lock = threading.RLock()
        self._call_ids = itertools.count()
        self._calls: dict[int, tuple[int, concurrent.futures.Future]] = {}
        # Which replica runs each core request (an n > 1 request's children each).
        self._owner: dict[str, int] = {}
        self.router = PrefixRouter(num_replicas, self.config.cache.num_blocks)
        self._poller = zmq.Poller()
        for core in self.cores:
            self._poller.register(core.output, zmq.POLLIN)
        self._received: collections.deque[tuple[int, list[Any]]] = collections.deque()
        if num_replicas > 1:
            logger.info(
                "%d engine-core processes (data parallel), requests routed by cached prefix "
                "then load",
                num_replicas,
            )

    @property
    def num_replicas(self) -> int:
        return len(self.cores)

    # --- LLMEngine's interface, for the server ----------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.config.sampling_defaults)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Hand every later step's stats to `stat_logger` (on the output thread)."""
        self.stat_loggers.append(stat_logger)

    def add_requests(self, groups: list[list[EngineCoreRequest]]) -> list[int]:
        """Send each group (one request, or its n children) to a replica; returns each group's
        replica. EngineDeadError if none is running."""
        with self.lock:
            replicas: list[int] = []
            batches: dict[int, list[Any]] = {}
            for group in groups:
                keys: list[int] = []
                if self.num_replicas > 1:
                    block_size = self.config.cache.block_size
                    extend_block_hashes(keys, group[0].prompt_token_ids, block_size)
                try:
                    replica = self.router.route(keys, len(group))
                except ValueError as exc:
                    raise EngineDeadError(f"The engine is not running: {exc}") from None
                replicas.append(replica)
                for request in group:
                    self._owner[request.request_id] = replica
                batches.setdefault(replica, []).extend(serial.encode_request(r) for r in group)
            for replica, items in batches.items():
                self.send(["add", items], replica)
            return replicas

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        with self.lock:
            self.abort_core_requests(self.output_processor.abort_requests(request_ids))

    def abort_core_requests(self, core_ids: list[str], stopped: bool = False) -> None:
        """Abort core requests (by the ids the cores know) in the replicas that run them."""
        with self.lock:
            by_replica: dict[int, list[str]] = {}
            for core_id in core_ids:
                replica = self._owner.pop(core_id, None)
                if replica is not None:
                    self.router.finished(replica)
                    by_replica.setdefault(replica, []).append(core_id)
            for replica, ids in by_replica.items():
                try:
                    self.send(["abort", ids, stopped], replica)
                except EngineDeadError:
                    pass  # nothing left to abort there

    def finished(self, replica: int, core_ids: list[str]) -> None:
        """These core requests of `replica` have ended there."""
        with self.lock:
            for core_id in core_ids:
                if self._owner.pop(core_id, None) is not None:
                    self.router.finished(replica)

    def forget_replica(self, replica: int) -> None:
        """`replica` has gone: no request goes there any more, none is thought to run there."""
        with self.lock:
            self.cores[replica].live = False
            self.router.mark_dead(replica)
            self._owner = {k: r for k, r in self._owner.items() if r != replica}

    def live_replicas(self) -> list[int]:
        return [core.index for core in self.cores if core.live]

    def has_unfinished_requests(self) -> bool:
        """Requests whose final output is not out, here or in a core."""
        with self.lock:
            if self.output_processor.has_unfinished_requests():
                return True
        return any(self.call_all("has_unfinished_requests"))

    def get_num_unfinished_requests(self) -> int:
        with self.lock:
            return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        reset = all(self.call_all("reset_prefix_cache"))
        if reset:
            with self.lock:
                self.router.forget()
        return reset

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Abort every request in flight (their callers get their final outputs), then put
        every core to sleep (EngineCore.sleep); requests added while asleep wait in the cores
        for wake_up. The aborts and the sleep go out under the lock, so no request added in
        between reaches a core that then sleeps with it."""
        check_sleep(level, mode, self.config.enable_sleep_mode)
        with self.lock:
            self.abort_request(self.output_processor.unfinished_request_ids())
            futures = [self._start_call(r, "sleep", (level, mode)) for r in self.live_replicas()]
            if level >= 1:
                self.router.forget()  # the cores forget their cached prefixes
        for future in futures:
            future.result(_SLOW_CALL_TIMEOUT_S)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.call_all("wake_up", tags, timeout_s=_SLOW_CALL_TIMEOUT_S)

    def is_sleeping(self) -> bool:
        return any(self.call_all("is_sleeping"))

    def start_profile(self) -> None:
        self.call_all("start_profile")

    def stop_profile(self) -> None:
        self.call_all("stop_profile", timeout_s=_SLOW_CALL_TIMEOUT_S)

    def make_stats(self) -> SchedulerStats:
        """The replicas' stats together (make_stats_per_replica for each one's)."""
        return SchedulerStats.combined(self.make_stats_per_replica())

    def make_stats_per_replica(self) -> list[SchedulerStats]:
        return [serial.decode_scheduler_stats(s) for s in self.call_all("make_stats")]

    def kv_snapshots(self) -> list[dict[str, Any]]:
        """Each live replica's KV snapshot (EngineCore.kv_snapshot) with its index
        ("engine"), in replica order."""
        replicas = self.live_replicas()
        snapshots = self.call_all("kv_snapshot")
        return [{**s, "engine": r} for r, s in zip(replicas, snapshots, strict=True)]

    def check_integrity(self) -> None:
        self.call_all("check_integrity")

    # --- the boundary -----------------------------------------------------------------------------

    def send(self, message: list[Any], replica: int = 0) -> None:
        """Never blocks (see the sockets in _CoreProcess); EngineDeadError if refused all the
        same."""
        with self.lock:
            try:
                self.cores[replica].input.send(serial.pack(message), zmq.NOBLOCK)
            except zmq.Again:
                raise EngineDeadError("The engine is not running: its process has gone.") from None

    def call_utility(
        self, method: str, *args: Any, replica: int = 0, timeout_s: float = 60.0
    ) -> Any:
        """Run `core.<method>(*args)` in a core process between two of its steps; from any
        thread but the output thread (which delivers the answer)."""
        return self._start_call(replica, method, args).result(timeout_s)

    def call_all(self, method: str, *args: Any, timeout_s: float = 60.0) -> list[Any]:
        """call_utility on every live replica, side by side; their answers in order."""
        futures = [self._start_call(r, method, args) for r in self.live_replicas()]
        return [future.result(timeout_s) for future in futures]

    def _start_call(
        self, replica: int, method: str, args: tuple[Any, ...]
    ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = (replica, future)
            try:
                self.send(["utility", call_id, method, list(args)], replica)
            except EngineDeadError:
                del self._calls[call_id]
                raise
        return future

    def resolve_call(self, call_id: int, ok: bool, result: Any) -> None:
        with self.lock:
            _, future = self._calls.pop(call_id, (None, None))
        if future is None:
            return
        if ok:
            future.set_result(result)
        else:
            future.set_exception(RuntimeError(f"The engine core's call failed: {result}"))

    def fail_calls(self, error: BaseException, replica: int | None = None) -> None:
        """Fail the calls waiting on `replica` (on every replica: None)."""
        with self.lock:
            failed = [
                call_id
                for call_id, (owner, _) in self._calls.items()
                if replica is None or owner == replica
            ]
            futures = [self._calls.pop(call_id)[1] for call_id in failed]
        for future in futures:
            future.set_exception(error)

    def receive(self, timeout_ms: int) -> tuple[int, list[Any]] | None:
        """A core's next message with the core's index, or None after `timeout_ms` (the output
        thread only). Each poll takes one message from each core that has one: a busy core
        never starves the others."""
        if not self._received:
            for socket, _ in self._poller.poll(timeout_ms):
                replica = next(c.index for c in self.cores if c.output is socket)
                self._received.append((replica, serial.unpack(socket.recv())))
        return self._received.popleft() if self._received else None

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the cores (after a "shutdown" each exits on its own), release the sockets."""
        for core in self.cores:
            core.close(timeout_s)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class AsyncMPEngine(AsyncEngine):
    """AsyncEngine's interface over engine-core processes. Commands take effect at once, on
    the caller's thread (under the engine's lock), instead of waiting for a step loop here:
    the step loops are the cores'.

    With several replicas, one that dies or whose step fails fails its own requests only;
    the others keep serving. When none is left, the engine is dead."""

    engine: MPEngine  # type: ignore[assignment]

    def __init__(self, engine: MPEngine) -> None:
        super().__init__(engine)  # type: ignore[arg-type]
        self._on_dead: list[Callable[[str], None]] = []
        # Set once the cores were told to stop: their exit is then no death.
        self._closing = False
        # Which replica runs each request in _streams (its children all run there).
        self._replica_of: dict[str, int] = {}
        self._last_watch = time.monotonic()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncMPEngine:
        """Start the engine-core processes and wait until their models are loaded."""
        return cls(MPEngine(args))

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` (on the output thread) once no core process is left."""
        self._on_dead.append(callback)

    @property
    def is_running(self) -> bool:
        return super().is_running and any(
            core.live and core.process.is_alive() for core in self.engine.cores
        )

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is in flight (callers get their final outputs), stop the core
        processes and the output thread. Idempotent."""
        if self._closing:
            return
        self._closing = True
        engine = self.engine
        engine.abort_request(list(self._streams))
        for core in engine.cores:
            if core.process.is_alive():
                try:
                    engine.send(["shutdown"], core.index)
                except EngineDeadError:
                    pass
        for core in engine.cores:
            core.process.join(timeout_s)
        super().shutdown(timeout_s)
        engine.close(timeout_s)
        with engine.lock:
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
        groups = []
        added: list[str] = []
        try:
            for request in command.requests:
                if isinstance(request.sampling_params, PoolingParams):
                    groups.append(
                        [
                            pooling_request(
                                engine.input_processor,
                                engine.output_processor,
                                request.request_id,
                                request.prompt,
                                request.sampling_params,
                                request.arrival_time,
                                request.priority,
                            )
                        ]
                    )
                    added.append(request.request_id)
                    continue
                groups.append(
                    fan_out(
                        engine.input_processor,
                        engine.output_processor,
                        request.request_id,
                        request.prompt,
                        request.sampling_params,
                        request.output_kind,
                        request.arrival_time,
                        request.priority,
                    )
                )
                added.append(request.request_id)
            replicas = engine.add_requests(groups)
        except Exception as exc:
            # All or nothing: one rejected prompt rejects the call.
            engine.output_processor.abort_requests(added)
            # Forgets those; other requests' aborts flushed with them go to their streams.
            self._deliver(engine.output_processor.process_outputs([]).request_outputs)
            self._send(command.stream, [exc])
            return
        for request, replica in zip(command.requests, replicas, strict=True):
            self._streams[request.request_id] = command.stream
            self._replica_of[request.request_id] = replica

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        super()._deliver(outputs)
        for output in outputs:
            if output.finished:
                self._replica_of.pop(output.request_id, None)

    # --- the output thread ------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                received = engine.receive(_POLL_MS)
                if received is not None:
                    self._handle(*received)
                now = time.monotonic()
                if (received is None or now - self._last_watch > _POLL_MS / 1000) and (
                    not self._closing
                ):
                    self._last_watch = now
                    if not self._watch_processes():
                        return
        except BaseException as exc:  # a bug in this loop: nobody may be left waiting
            logger.exception("the engine's output thread crashed")
            self._died(f"the engine's output thread crashed: {exc!r}")
            raise

    def _watch_processes(self) -> bool:
        """Handle replicas that died since the last look; False once none is left."""
        engine = self.engine
        for core in engine.cores:
            if core.live and not core.process.is_alive():
                reason = f"the engine-core process exited (code {core.process.exitcode})"
                if len(engine.live_replicas()) == 1:
                    core.live = False
                    self._died(reason)
                    return False
                self._replica_died(core.index, reason)
        return True

    def _handle(self, replica: int, message: list[Any]) -> None:
        engine = self.engine
        kind = message[0]
        if kind == "step":
            _, outputs, iteration, scheduler = message
            core_outputs = [serial.decode_output(item) for item in outputs]
            with engine.lock:
                engine.finished(
                    replica, [o.request_id for o in core_outputs if o.finish_reason is not None]
                )
                processed = engine.output_processor.process_outputs(core_outputs)
                # The one backward edge: stop strings found in the text end those requests.
                if processed.reqs_to_abort:
                    engine.abort_core_requests(processed.reqs_to_abort, stopped=True)
                self._deliver(processed.request_outputs)
            self._num_steps += 1
            record_stats(
                self.engine.stat_loggers,
                serial.decode_scheduler_stats(scheduler),
                add_finished_requests(serial.decode_iteration_stats(iteration), processed),
                replica,
            )
        elif kind == "utility":
            engine.resolve_call(*message[1:])
        elif kind == "failed":
            logger.error("the engine core %d's step failed: %s", replica, message[1])
            error = EngineStepError(f"The engine failed while running this request: {message[1]}")
            with engine.lock:
                request_ids = self._fail_streams(error, self._requests_on(replica))
                engine.abort_request(request_ids)
        else:
            logger.error("unknown message %r from the engine core", kind)

    def _requests_on(self, replica: int) -> list[str]:
        return [r for r, owner in self._replica_of.items() if owner == replica]

    def _replica_died(self, replica: int, reason: str) -> None:
        """One replica of several has gone: its requests fail, the others serve on."""
        logger.error(
            "engine %d: %s; failing its requests, the other engines serve on", replica, reason
        )
        engine = self.engine
        error = EngineDeadError(f"The engine is not running: engine {replica}: {reason}")
        with engine.lock:
            engine.forget_replica(replica)
            request_ids = self._fail_streams(error, self._requests_on(replica))
            for request_id in request_ids:
                self._replica_of.pop(request_id, None)
            engine.output_processor.abort_requests(request_ids)
        engine.fail_calls(error, replica)

    def _died(self, reason: str) -> None:
        logger.error("%s: failing every request in flight", reason)
        self._dead_reason = reason
        error = EngineDeadError(f"The engine is not running: {reason}")
        with self.engine.lock:
            self._fail_streams(error)
            self._replica_of.clear()
        self.engine.fail_calls(error)
        for callback in self._on_dead:
            try:
                callback(reason)
            except Exception:
                logger.exception("on_dead callback %r failed", callback)
