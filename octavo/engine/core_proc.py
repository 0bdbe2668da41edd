"""The engine-core process: an EngineCore stepping in a loop of its own, fed and read over ZeroMQ
by the API server process (octavo/engine/core_client.py), messages in msgpack (serial.py).

    loop: read commands (block only when idle) -> step -> send the step's outputs as one message

The engine is built and stepped on the process's main thread: one OpenMP thread team for all
of its torch work (see async_engine.py for why that matters).

Lifetime: the process is started by its frontend with one end of a pipe; it reports "ready"
(or why it could not start) on that pipe, then watches it. The other end closes when the
frontend process ends, however it ends (SIGKILL included), and the engine core then exits at
once: it never outlives its frontend. A step that raises aborts every request (the frontend
fails their callers); after `_MAX_CONSECUTIVE_STEP_FAILURES` in a row the process exits non-zero.

Must not: tokenize, detokenize or look at text (the frontend does), or block on the frontend.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import zmq

from octavo.config import EngineArgs, EngineConfig
from octavo.core.outputs import EngineCoreOutput
from octavo.core.request import FinishReason
from octavo.engine import serial
from octavo.engine.core import EngineCore
from octavo.worker.executor import WorkerDeadError, exit_with_parent

logger = logging.getLogger(__name__)

_MAX_CONSECUTIVE_STEP_FAILURES = 3
# While idle, how often the loop checks that it could still step (tensor-parallel workers).
_IDLE_POLL_MS = 1000

# What a frontend may call on the core between steps, by name (a "utility" message).
UTILITY_METHODS = frozenset(
    {
        "reset_prefix_cache",
        "make_stats",
        "kv_snapshot",
        "check_integrity",
        "has_unfinished_requests",
        "sleep",
        "wake_up",
        "is_sleeping",
        "start_profile",
        "stop_profile",
    }
)


@dataclass(frozen=True)
class CoreInfo:
    """What the frontend learns from the core at start-up (sent once, pickled, on the pipe)."""

    config: EngineConfig
    vocab_size: int
    eos_token_ids: tuple[int, ...]


def run_engine_core(
    args: EngineArgs,
    input_address: str,
    output_address: str,
    conn: Connection,
    engine_index: int = 0,
    cpus: list[int] | None = None,
) -> None:
    """The process's target: build the core, report, serve the frontend until told to stop or
    until the frontend is gone. `cpus`: the CPUs this core's threads run on (a data-parallel
    replica's share), None for all the process was given."""
    # Ctrl-C reaches the whole process group; the frontend decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The frontend started this process as a daemon (ended with it); that flag would forbid
    # children of its own, the tensor-parallel workers, which end with this process anyway
    # (each watches a pipe to it). The flag is only this process's copy: the frontend still
    # ends it on exit.
    multiprocessing.current_process().daemon = False
    name = "%(name)s" if args.data_parallel_size == 1 else f"[engine {engine_index}] %(name)s"
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s {name}: %(message)s")
    try:
        if cpus is not None:
            # Before torch's first parallel region: its thread team takes these CPUs.
            import torch

            os.sched_setaffinity(0, cpus)
            torch.set_num_threads(len(cpus))
            logger.info("engine %d runs on CPUs %s", engine_index, _cpu_list(cpus))
        from octavo.engine.llm_engine import build_core_parts, freeze_startup_objects

        config, runner, tokenizer, eos = build_core_parts(args)
        core = EngineCore(config, runner, tokenizer, eos)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        conn.close()
        sys.exit(1)
    conn.send(
        (
            "ready",
            CoreInfo(config, runner.vocab_size, eos),
        )
    )
    # Never outlive the frontend (a frontend that shuts down cleanly joins the core first).
    # The sockets' folder is the frontend's; if it dies, the core clears it as it leaves.
    socket_dir = os.path.dirname(input_address.removeprefix("ipc://"))
    clear = functools.partial(shutil.rmtree, socket_dir, ignore_errors=True)
    threading.Thread(target=exit_with_parent, args=(conn, clear), daemon=True).start()
    freeze_startup_objects()
    context = zmq.Context()
    # Each sending side connects (see MPEngine.__init__).
    inputs = context.socket(zmq.PULL)
    inputs.bind(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    code = EngineCoreLoop(core, inputs, outputs).run()
    core.shutdown()
    outputs.close()
    inputs.close()
    context.term()
    sys.exit(code)


def _cpu_list(cpus: list[int]) -> str:
    """0-3,8 style."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class EngineCoreLoop:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self._poller = zmq.Poller()
        self._poller.register(inputs, zmq.POLLIN)
        # Requests the core could not add: their ERROR finish goes out with the next message.
        self._failed: list[EngineCoreOutput] = []

    def run(self) -> int:
        """Serve until a "shutdown" message (0) or repeated step failures (1)."""
        core = self.core
        num_failures = 0
        while True:
            # Asleep, the core takes no step: requests added meanwhile wait for wake_up.
            can_step = core.has_unfinished_requests() and not core.is_sleeping()
            idle = not can_step and not self._failed
            commands = self._read_commands(block=idle)
            if idle and not commands:  # the poll timed out: still able to step?
                try:
                    core.check_health()
                except Exception:
                    logger.exception("the engine cannot step any more")
                    return 1
                continue
            stopping = False
            for command in commands:
                stopping = self._apply(command) or stopping
            if stopping:
                self._drain()
                return 0
            if core.is_sleeping() or not core.has_unfinished_requests():
                if commands:  # aborts and failed adds still owe their callers a message
                    self._send_step([], 0)
                continue
            try:
                step = core.step()
            except WorkerDeadError as exc:
                # Not this step's fault: the executor has lost a rank for good.
                logger.error("engine step failed: %s", exc)
                self._abort_all()
                self.outputs.send(serial.pack(["failed", f"{exc}"]))
                return 1
            except Exception as exc:
                num_failures += 1
                logger.exception("engine step failed (%d in a row)", num_failures)
                self._abort_all()
                self.outputs.send(serial.pack(["failed", f"{exc!r}"]))
                if num_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
                    return 1
                continue
            num_failures = 0
            self._send_step(step.outputs, step.num_scheduled_tokens)

    def _read_commands(self, block: bool) -> list[list[Any]]:
        commands = []
        if block:
            self._poller.poll(_IDLE_POLL_MS)
        while True:
            try:
                commands.append(serial.unpack(self.inputs.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return commands

    def _apply(self, command: list[Any]) -> bool:
        """Apply one command; True for "shutdown"."""
        kind = command[0]
        core = self.core
        if kind == "add":
            for item in command[1]:
                request = serial.decode_request(item)
                try:
                    core.add_request(request)
                except ValueError as exc:
                    self._failed.append(
                        EngineCoreOutput(
                            request.request_id, [], None, FinishReason.ERROR, error=str(exc)
                        )
                    )
        elif kind == "abort":
            core.abort_requests(command[1], stopped=command[2])
        elif kind == "utility":
            _, call_id, method, call_args = command
            try:
                if method not in UTILITY_METHODS:
                    raise ValueError(f"no utility method {method!r}")
                result = getattr(core, method)(*call_args)
                if dataclasses.is_dataclass(result):
                    result = dataclasses.asdict(result)
                reply = ["utility", call_id, True, result]
            except Exception as exc:
                reply = ["utility", call_id, False, f"{exc!r}"]
            self.outputs.send(serial.pack(reply))
        elif kind == "shutdown":
            return True
        else:
            logger.error("unknown command %r", kind)
        return False

    def _send_step(self, outputs: list[EngineCoreOutput], num_scheduled_tokens: int) -> None:
        core = self.core
        if self._failed:
            outputs = [*self._failed, *outputs]
            self._failed = []
        message = [
            "step",
            [serial.encode_output(output) for output in outputs],
            serial.encode_iteration_stats(core.take_iteration_stats(num_scheduled_tokens)),
            serial.encode_scheduler_stats(core.make_stats()),
        ]
        self.outputs.send(serial.pack(message))

    def _abort_all(self) -> None:
        try:
            self.core.abort_requests(list(self.core.scheduler.requests))
        except Exception:
            logger.exception("aborting the failed requests failed too")

    def _drain(self) -> None:
        """On shutdown: abort everything; the last message carries its stats."""
        self._abort_all()
        self._send_step([], 0)
