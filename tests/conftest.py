"""Settings for the whole test session."""

from __future__ import annotations

import os

from octavo.model.kernels import PACKED_MAX_ROWS

# Loading a model times the packed matmul kernel against torch's GEMM to pick which one takes
# large batches. Tests keep the fixed default instead, so that which kernel runs does not depend
# on how busy the machine is; tests/model/test_kernels.py covers the calibration itself.
os.environ.setdefault("OCTAVO_PACKED_MAX_ROWS", str(PACKED_MAX_ROWS))
