"""Memory that does not grow with the variety of matmul shapes: torch's bfloat16 CPU matmuls
cache what each shape built (oneDNN's primitives, ideep's cache over them), 1,024 shapes each
by default, ~1.6 MB a shape for the embedded model's MLP; the worker caps both before the
model loads. A fresh process, as the caches live for the process."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
import torch
import torch.nn.functional as F
from octavo.worker.setup import bound_matmul_shape_caches

if sys.argv[1] == "bounded":
    bound_matmul_shape_caches()


def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024


weight = torch.randn(1536, 576).bfloat16()
sizes = []
for rows in range(1, 601):  # 600 shapes, as 600 prompt-chunk lengths would give
    F.linear(torch.randn(rows, 576).bfloat16(), weight)
    if rows in (300, 600):
        sizes.append(rss_mib())
print(sizes[1] - sizes[0])
"""


def late_growth_mib(mode: str) -> float:
    """Resident memory the second 300 shapes add, once the caches (if bounded) are full."""
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return float(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bfloat16_matmuls_of_many_shapes_level_off():
    """Unbounded, the second 300 shapes add ~400 MiB (Zen 4); capped, 8-11 MiB there and up to
    24 MiB on other CPUs (the allocator's arenas keep some of what the evicted shapes freed).
    A cap that does not hold gives hundreds of MiB, far above the bound."""
    growth = late_growth_mib("bounded")
    assert growth < 64, f"300 more matmul shapes grew resident memory by {growth:.0f} MiB"
