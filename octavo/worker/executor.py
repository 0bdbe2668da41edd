"""The tensor-parallel executors: the model runner's interface over tensor_parallel_size ranks
joined by torch.distributed (gloo on a CPU, NCCL on CUDA), one per way the ranks are started
(`distributed_executor_backend`, vLLM's names):

    mp                 rank 0 in the engine's process, ranks 1..N-1 worker processes it spawns
    ray                rank 0 in the engine's process, ranks 1..N-1 Ray actors on the cluster
                       ray.init() finds (RAY_ADDRESS, or a local `ray start --head`; else one
                       started for this engine), so a model can span machines
    external_launcher  every rank a whole engine in a process torchrun (or another launcher
                       setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) started; offline LLM
                       only, the same prompts in the same order on every rank

With mp and ray one message per step crosses to the workers:

    engine process (rank 0)                     worker (rank r)
    execute(scheduler_output):
        broadcast scheduler_output   ------->   receive it
        runner.execute(...)                     runner.execute(...)
            all-reduce per attention / MLP  <-->    the same collectives
            logits gathered, tokens drawn           the same logits, the same draw
        -> ModelRunnerOutput                    (its output is the same; dropped)

the SchedulerOutput (with its grammar bitmask), pickled by torch.distributed's object
broadcast. Every rank then runs the same runner code on the same inputs: after each all-reduce
every rank holds the same hidden states, after the gather the same logits, and with the same
seed and the same number of threads per rank the same draws, so each worker's persistent batch
follows rank 0's without tokens being sent back. Under external_launcher nothing is broadcast:
each rank's scheduler (plain Python, no clocks) makes the same decisions from the same requests
over the same KV capacity (rank 0's, agreed at start-up), so its outputs are rank 0's.

Lifetime: an mp worker watches a pipe to the engine's process and exits when it closes (no
orphans, SIGKILL included); Ray ends the actors of a driver that has gone. A worker whose step
raises exits, which fails rank 0's next collective, so the engine's step fails instead of
hanging; `execute` also checks first that every worker is alive.
"""

from __future__ import annotations

import dataclasses
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
from octavo.worker.model_runner import ModelRunner
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


class _Executor:
    """What every executor gives the engine: the runner's interface, rank 0's runner doing
    the work; `execute` hands each step to the other ranks first (`_broadcast`)."""

    runner: ModelRunner
    backend: Any

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def model_config(self):
        return self.runner.model_config

    def check_health(self) -> None:
        """WorkerDeadError if a worker has gone."""

    def _broadcast(self, scheduler_output: SchedulerOutput) -> None:
        dist.broadcast_object_list([scheduler_output], src=0)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        try:
            self._broadcast(scheduler_output)
            return self.runner.execute(scheduler_output)
        except RuntimeError:
            # A collective that failed because a peer has gone says so.
            self.check_health()
            raise


class MultiprocExecutor(_Executor):
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
            self.tp, self.runner, self.backend = join_group(
                config, 0, init_method, shares[0], threads
            )
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

    def check_health(self) -> None:
        for rank, process in enumerate(self._workers, start=1):
            if not process.is_alive():
                raise WorkerDeadError(
                    f"tensor-parallel worker {rank} exited (code {process.exitcode})"
                )

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


class RayExecutor(_Executor):
    """Rank 0 in this process, ranks 1..N-1 Ray actors (see the module)."""

    def __init__(self, config: EngineConfig) -> None:
        try:
            import ray
        except ImportError as exc:
            raise RuntimeError(
                "distributed_executor_backend='ray' needs Ray: pip install 'octavo[ray]'."
            ) from exc
        from ray.util import get_node_ip_address

        self._ray = ray
        self.size = size = config.tensor_parallel_size
        # Disconnected again at shutdown if this executor connected.
        self._connected = not ray.is_initialized()
        if self._connected:
            # RAY_ADDRESS or a cluster `ray start` made on this machine; else a local one.
            ray.init(log_to_driver=True, configure_logging=False)
        node = get_node_ip_address()
        init_method = f"tcp://{node}:{_free_port()}"
        shares = split_cpus(size, equal=True)
        threads = len(shares[0]) if shares[0] is not None else 1
        options: dict[str, Any] = {"num_cpus": threads}
        if config.device.startswith("cuda"):
            options["num_gpus"] = 1
        actor_class = ray.remote(RayRankWorker)
        self._actors = [actor_class.options(**options).remote() for _ in range(1, size)]
        self._loops: list[Any] = []
        self._saved = (os.sched_getaffinity(0), torch.get_num_threads())
        try:
            # Every actor runs (its process started, octavo imported) before the rendezvous,
            # which would otherwise wait out its timeout for one that cannot start.
            ray.get([actor.started.remote() for actor in self._actors], timeout=READY_TIMEOUT_S)
            # The actors join the group while this process does (each call blocks its actor
            # until every rank has joined).
            joined = [
                actor.join.remote(config, rank, init_method, node, shares[rank], threads)
                for rank, actor in enumerate(self._actors, start=1)
            ]
            self.tp, self.runner, self.backend = join_group(
                config, 0, init_method, shares[0], threads
            )
            nodes = ray.get(joined, timeout=READY_TIMEOUT_S)
            self._loops = [actor.serve.remote() for actor in self._actors]
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor parallel: %d ranks (gloo), rank 0 here and %d Ray actors on %s, %d threads "
            "each; each rank holds 1/%d of the heads, MLP columns and vocabulary, and of every "
            "token's KV",
            size,
            size - 1,
            ", ".join(sorted(set(nodes))),
            threads,
            size,
        )

    def check_health(self) -> None:
        # An actor's step loop ends before shutdown only by failing.
        ended, _ = self._ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        for ref in ended:
            rank = self._loops.index(ref) + 1
            try:
                self._ray.get(ref)
                reason = "its loop ended"
            except Exception as exc:  # the actor's error or its death
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise WorkerDeadError(f"tensor-parallel worker {rank} (Ray actor) failed: {reason}")

    def shutdown(self) -> None:
        if dist.is_initialized():
            if self._loops:
                try:
                    self.check_health()
                    dist.broadcast_object_list([None], src=0)
                    self._ray.get(self._loops, timeout=30)
                except Exception:
                    logger.exception("stopping the tensor-parallel Ray actors failed")
            dist.destroy_process_group()
        for actor in self._actors:
            self._ray.kill(actor)
        self._actors, self._loops = [], []
        if self._connected:
            self._ray.shutdown()
            self._connected = False
        os.sched_setaffinity(0, self._saved[0])
        torch.set_num_threads(self._saved[1])


class RayRankWorker:
    """A tensor-parallel rank as a Ray actor (ray.remote wraps it in RayExecutor, so this
    module imports without Ray)."""

    def started(self) -> None:
        """Returns once the actor runs."""

    def join(
        self,
        config: EngineConfig,
        rank: int,
        init_method: str,
        driver_node: str,
        cpus: list[int] | None,
        threads: int,
    ) -> str:
        """Join the group and build this rank's runner; the node's address."""
        from ray.util import get_node_ip_address

        node = get_node_ip_address()
        # The CPU share applies on the driver's machine; elsewhere the actor's threads.
        cpus = cpus if node == driver_node else None
        _, self.runner, _ = join_group(config, rank, init_method, cpus, threads)
        return node

    def serve(self) -> None:
        """The step loop until rank 0's None step; an error fails the call (and, through the
        collective, rank 0's step)."""
        serve_steps(self.runner)
        dist.destroy_process_group()


class ExternalLauncherExecutor(_Executor):
    """This process is one rank of a group its launcher started (see the module): it joins
    the group from the launcher's environment, takes rank 0's KV capacity and scheduler
    settings, and runs its own steps without broadcasting them."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        missing = [
            n for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if n not in os.environ
        ]
        if missing:
            raise RuntimeError(
                "distributed_executor_backend='external_launcher' runs in processes a launcher "
                f"started (torchrun --nproc-per-node={size} script.py); {', '.join(missing)} "
                "is not set."
            )
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(
                f"tensor_parallel_size={size} but the launcher started {world} processes "
                "(WORLD_SIZE); they must be equal."
            )
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        shares = split_cpus(local_size, equal=True)
        threads = len(shares[0]) if shares[0] is not None else 1
        self._saved = (os.sched_getaffinity(0), torch.get_num_threads())
        _pin(shares[local_rank], threads)
        if not dist.is_initialized():
            dist.init_process_group(
                _backend_for(config.device), init_method="env://", timeout=COLLECTIVE_TIMEOUT
            )
        # One KV capacity and one set of scheduler settings for every rank's scheduler (the
        # default capacity is measured from each machine's free memory).
        agreed: list[Any] = [(config.cache, config.scheduler)]
        dist.broadcast_object_list(agreed, src=0)
        self.config = dataclasses.replace(config, cache=agreed[0][0], scheduler=agreed[0][1])
        self.tp = TPGroup(rank, size, dist.group.WORLD)
        self.runner, self.backend = build_rank_runner(self.config, self.tp)
        logger.info(
            "tensor parallel: rank %d of %d (external launcher, gloo), %d threads; this rank "
            "holds 1/%d of the heads, MLP columns and vocabulary, and of every token's KV",
            rank,
            size,
            threads,
            size,
        )

    def _broadcast(self, scheduler_output: SchedulerOutput) -> None:
        """Nothing: every rank scheduled the same step. (The launcher watches the processes;
        a rank that dies fails the others' next collective.)"""

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
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
        _, runner, _ = join_group(config, rank, init_method, cpus, threads)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    conn.send(("ready", None))
    threading.Thread(target=exit_with_parent, args=(conn,), daemon=True).start()
    try:
        serve_steps(runner)
    except BaseException:
        logger.exception("tensor-parallel worker %d failed; exiting", rank)
        os._exit(1)
    dist.destroy_process_group()
    os._exit(0)


def join_group(
    config: EngineConfig, rank: int, init_method: str, cpus: list[int] | None, threads: int
) -> tuple[TPGroup, ModelRunner, Any]:
    """Pin this process to its CPU share, join the group as `rank` and build its runner:
    (its group, its runner, the runner's backend)."""
    _pin(cpus, threads)
    dist.init_process_group(
        _backend_for(config.device),
        init_method=init_method,
        rank=rank,
        world_size=config.tensor_parallel_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    tp = TPGroup(rank, config.tensor_parallel_size, dist.group.WORLD)
    runner, backend = build_rank_runner(config, tp)
    return tp, runner, backend


def serve_steps(runner: ModelRunner) -> None:
    """A worker rank's loop: run every step rank 0 broadcasts, until a None step."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            return
        runner.execute(message[0])


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
