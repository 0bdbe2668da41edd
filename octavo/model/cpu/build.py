"""Compiling and loading the C++ kernels of csrc/ into this process, once.

The sources are compiled on first use with torch's extension builder into a cache folder
(`OCTAVO_KERNEL_CACHE`, default ~/.cache/octavo/kernels/<torch>-<source hash>), which takes
about 20 s once per machine and torch version; `python -m octavo.model.cpu` builds it ahead of
time. `load()` is called only by a backend that chose the CPU kernels (model/backends/): a
process that never picks them never compiles anything. Without a compiler the load fails, is
logged once, and the backend falls back to the torch ops. Knows nothing of models.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# Built on the machine that runs it, so the host's vector units are fair game. -fopenmp makes
# at::parallel_for (an inline template) parallel in this library: without it the pragmas are
# ignored and every kernel runs on one thread. The OpenMP runtime is the one torch already
# loaded (same soname), so kernels and torch's own ops share one thread pool.
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]


def sources() -> list[Path]:
    """The translation units, one per kernel family, plus the registration of the operators."""
    return sorted(_CSRC.glob("*.cpp"))


def _host_isa() -> str:
    """The CPU's feature flags: -march=native builds for them, so a build cache shared between
    machines (a mounted home) must not hand an AVX-512 build to a CPU without it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine()


def build_dir() -> Path:
    """Where this source, these flags, this CPU and this torch build their library."""
    digest = hashlib.sha256(" ".join(_CFLAGS + _LDFLAGS).encode() + _host_isa().encode())
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    root = os.environ.get("OCTAVO_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "octavo", "kernels"
    )
    version = torch.__version__.replace("+", "_")
    return Path(root) / f"{version}-{digest.hexdigest()[:12]}"


@functools.cache
def load() -> bool:
    """Build (once per machine) and load the library; True once torch.ops.octavo is usable.
    A failure (no compiler, no ninja, a read-only home) is logged with its reason and returns
    False; it is not retried in this process."""
    try:
        from torch.utils.cpp_extension import load as load_extension

        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        load_extension(
            name="octavo_cpu_kernels",
            sources=[str(path) for path in sources()],
            build_directory=str(directory),
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            is_python_module=False,
            verbose=False,
        )
        elapsed = time.perf_counter() - start
        if elapsed > 1.0:
            logger.info("built the CPU kernels in %.1f s (%s)", elapsed, directory)
        return True
    except Exception as exc:  # any build failure means: use the torch ops
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        logger.warning("CPU kernels unavailable (%s: %s)", type(exc).__name__, first_line)
        return False


def vectorized() -> bool:
    """Whether the loaded library has its AVX2 (or AVX-512) paths: without them the kernels run
    plain loops, which for sample_categorical are slower than torch's vectorised ops. False
    when the library is not loaded."""
    return load() and bool(torch.ops.octavo.vectorized())


def isa() -> str:
    """The vector paths the build took, for the start-up log: avx512, avx2 or scalar."""
    if not vectorized():
        return "scalar"
    return "avx512" if panel_width() == 32 else "avx2"


def panel_width() -> int:
    """Output columns per packed panel: two of the kernels' vectors (32 where the build has
    AVX-512, else 16); packed weights must be laid out for the kernel that reads them."""
    return int(torch.ops.octavo.packed_panel()) if load() else 16
