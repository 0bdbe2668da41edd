"""The torch profiler around the engine's steps, vLLM's start_profile / stop_profile.

Owns one torch.profiler.profile at a time, started and stopped between two steps by the engine
core, on the thread that steps (torch records the ops of the thread that started it, and the
step runs there). Its settings are vLLM's ProfilerConfig keys (config.PROFILER_CONFIG_DEFAULTS);
the trace goes to `torch_profiler_dir` as torch's tensorboard handler names it
(`<worker>.<time>.pt.trace.json[.gz]`), viewable in Perfetto or TensorBoard.

Must not: start on its own (a profiler costs every step), or know of requests.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch

logger = logging.getLogger(__name__)


class TorchProfiler:
    def __init__(self, settings: dict[str, Any], worker_name: str = "") -> None:
        """`settings`: a resolved profiler config (config.resolve_profiler_config), non-empty.
        `worker_name` starts the trace file's name (default: host and process id)."""
        self.settings = settings
        self.trace_dir = settings["torch_profiler_dir"]
        self.worker_name = worker_name or f"{socket.gethostname()}_{os.getpid()}"
        self._profile: torch.profiler.profile | None = None

    @property
    def is_running(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        """Start recording (a second start while running is a no-op, as in vLLM)."""
        if self._profile is not None:
            logger.warning("the profiler is already running")
            return
        os.makedirs(self.trace_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        settings = self.settings
        self._profile = torch.profiler.profile(
            activities=activities,
            record_shapes=settings["torch_profiler_record_shapes"],
            profile_memory=settings["torch_profiler_with_memory"],
            with_stack=settings["torch_profiler_with_stack"],
            with_flops=settings["torch_profiler_with_flops"],
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                self.trace_dir,
                worker_name=self.worker_name,
                use_gzip=settings["torch_profiler_use_gzip"],
            ),
        )
        self._profile.start()
        logger.info("profiling; the trace goes to %s at stop_profile", self.trace_dir)

    def stop(self) -> None:
        """Stop recording and write the trace (seconds for a long run). A stop without a
        start is a no-op."""
        profile, self._profile = self._profile, None
        if profile is None:
            logger.warning("the profiler is not running")
            return
        profile.stop()
        logger.info("profiler trace written to %s", self.trace_dir)
