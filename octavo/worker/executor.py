"""The tensor-parallel executor: rank 0's model runner in the engine's process, ranks 1..N-1 in
worker processes of their own, all joined by torch.distributed (gloo on a CPU, NCCL on CUDA).

    engine process (rank 0)                     worker process (rank r)
    execute(scheduler_output):
        broadcast scheduler_output   ------->   receive it
        runner.execute(...)                     runner.execute(...)
            all-reduce per attention / MLP  <-->    the same collectives
            logits gathered, tokens drawn           the same logits, the same draw
        -> ModelRunnerOutput                    (its output is the same; dropped)

One message per step crosses to the workers: the SchedulerOutput (with its grammar bitmask),
pickled by torch.distributed's object broadcast. Every rank then runs the same runner code on
the same inputs: after each all-reduce every rank holds the same hidden states, after the
gather the same logits, and with the same seed and the same number of threads per rank the
same draws, so each worker's persistent batch follows rank 0's without tokens being sent
back. The CPUs are split evenly between the ranks (as many threads each).

Lifetime: each worker watches a pipe to the engine's process and exits when it closes (no
orphans, SIGKILL included); a worker whose step raises exits, which fails rank 0's next
collective, so the engine's step fails instead of hanging; `execute` also checks first that
every worker is alive.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from octavo.config import EngineConfig
from octavo.core.outputs import ModelRunnerOutput
from octavo.core.scheduler_output import SchedulerOutput
from octavo.model.parallel import TPGroup
from octavo.worker.device import split_cpus
from octavo.worker.setup import build_rank_runner

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer (a rank that died fails it at once; this bounds
# a rank that hangs).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
READY_TIMEOUT_S = 1800.0


class WorkerDeadError(RuntimeError):
    """A tensor-parallel worker process has exited."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pin(cpus: list[int] | None, threads: int) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)


def _backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class MultiprocExecutor:
    """The model runner's interface over tensor_parallel_size ranks (see the module)."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        self.size = size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        # The same thread count on every rank keeps their draws equal.
        shares = split_cpus(size, equal=True)
        # More ranks than CPUs: they share them, one thread each.
        threads = len(shares[0]) if shares[0] is not None else 1
        spawn = multiprocessing.get_context("spawn")
        self._workers: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(1, size):
            parent_conn, child_conn = spawn.Pipe()
            process = spawn.Process(
                target=run_worker,
                args=(config, rank, init_method, child_conn, shares[rank], threads),
                name=f"octavo-tp-worker-{rank}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            self._workers.append(process)
            self._conns.append(parent_conn)
        # Rank 0 runs in this process: what it changes of the process is given back.
        self._saved = (os.sched_getaffinity(0), torch.get_num_threads())
        try:
            # Each worker reports once it runs, then joins the group: a worker that cannot
            # start fails here instead of leaving the rendezvous to wait out its timeout.
            self._wait_for("started")
            _pin(shares[0], threads)
            dist.init_process_group(
                _backend_for(config.device),
                init_method=init_method,
                rank=0,
                world_size=size,
                timeout=COLLECTIVE_TIMEOUT,
            )
            self.tp = TPGroup(0, size, dist.group.WORLD)
            self.runner, self.backend = build_rank_runner(config, self.tp)
            self._wait_for("ready")
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor parallel: %d ranks (gloo), %d threads each; each rank holds 1/%d of the "
            "heads, MLP columns and vocabulary, and of every token's KV",
            size,
            threads,
            size,
        )

    def _wait_for(self, what: str) -> None:
        """Every worker's `what` message; RuntimeError if one reports an error or exits."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for rank, (conn, process) in enumerate(zip(self._conns, self._workers), start=1):
            while not conn.poll(0.5):
                if not process.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel worker {rank} exited (code {process.exitcode}) before "
                        f"it was {what}; its log above says why."
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel worker {rank} was not {what} in time.")
            kind, payload = conn.recv()
            if kind == "error":
                raise RuntimeError(f"tensor-parallel worker {rank} failed to start:\n{payload}")

    # --- the runner's interface -----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def model_config(self):
        return self.runner.model_config

    def check_health(self) -> None:
        """WorkerDeadError if a worker has exited."""
        for rank, process in enumerate(self._workers, start=1):
            if not process.is_alive():
                raise WorkerDeadError(
                    f"tensor-parallel worker {rank} exited (code {process.exitcode})"
                )

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        try:
            dist.broadcast_object_list([scheduler_output], src=0)
            return self.runner.execute(scheduler_output)
        except RuntimeError:
            # A collective that failed because a peer has gone says so.
            self.check_health()
            raise

    def shutdown(self) -> None:
        """Stop the workers (they leave their loop on a None step) and leave the group."""
        if dist.is_initialized():
            if all(p.is_alive() for p in self._workers):
                try:
                    dist.broadcast_object_list([None], src=0)
                except Exception:
                    logger.exception("telling the tensor-parallel workers to stop failed")
            dist.destroy_process_group()
        for process in self._workers:
            process.join(10)
            if process.is_alive():
                process.kill()
        for conn in self._conns:
            conn.close()
        self._workers, self._conns = [], []
        os.sched_setaffinity(0, self._saved[0])
        torch.set_num_threads(self._saved[1])


def run_worker(
    config: EngineConfig,
    rank: int,
    init_method: str,
    conn: Connection,
    cpus: list[int] | None,
    threads: int,
) -> None:
    """A worker process's target: join the group, build this rank's runner, then run every
    step rank 0 broadcasts until a None step or until the engine's process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s [tp rank {rank}] %(name)s: %(message)s"
    )
    conn.send(("started", None))
    try:
        _pin(cpus, threads)
        dist.init_process_group(
            _backend_for(config.device),
            init_method=init_method,
            rank=rank,
            world_size=config.tensor_parallel_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        runner, _ = build_rank_runner(config, TPGroup(rank, config.tensor_parallel_size))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    conn.send(("ready", None))
    threading.Thread(target=exit_with_parent, args=(conn,), daemon=True).start()
    while True:
        message: list[Any] = [None]
        try:
            dist.broadcast_object_list(message, src=0)
            if message[0] is None:
                break
            runner.execute(message[0])
        except BaseException:
            logger.exception("tensor-parallel worker %d failed; exiting", rank)
            os._exit(1)
    dist.destroy_process_group()
    os._exit(0)


def exit_with_parent(conn: Connection, before_exit: Callable[[], None] | None = None) -> None:
    """Block on a pipe the parent never writes to, so this returns only when the parent's end
    closes (it has gone, however it went); then run `before_exit` and leave at once: nobody
    is left to read what this process makes. Run it on a daemon thread."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    if before_exit is not None:
        before_exit()
    os._exit(1)
