"""`python -m octavo.model.cpu`: build the CPU kernels ahead of first use.
`python -m octavo.model.cpu --bench [...]`: then time decode-sized matmuls, or with
`--attention` paged decode attention, or with `--prefill` paged prefill attention (see
bench.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from octavo.model.cpu import build

logging.basicConfig(level=logging.INFO, format="%(message)s")
if len(sys.argv) > 1:
    from octavo.model.cpu.bench import add_bench_args, run_bench

    parser = argparse.ArgumentParser(prog="python -m octavo.model.cpu")
    parser.add_argument(
        "--bench",
        action="store_true",
        required=True,
        help="time the kernels against torch (matmuls; --attention, --prefill: attention)",
    )
    add_bench_args(parser)
    sys.exit(run_bench(parser.parse_args()))
sys.exit(0 if build.load() else 1)
