"""`python -m octavo.model.kernels`: build the CPU kernels ahead of first use."""

from __future__ import annotations

import logging
import sys

from octavo.model import kernels

logging.basicConfig(level=logging.INFO, format="%(message)s")
sys.exit(0 if kernels.available() else 1)
