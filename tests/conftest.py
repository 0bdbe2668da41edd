"""Settings for the whole test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from octavo.model.backends import select
from octavo.model.cpu.calibration import PACKED_MAX_ROWS, MatmulCalibration


@pytest.fixture(autouse=True, scope="session")
def _fixed_packed_max_rows() -> Iterator[None]:
    """Loading a model times the packed matmul kernel against torch's GEMM to pick which one
    takes large batches. Tests keep the fixed default instead (as the packed_max_rows setting
    would), so that which kernel runs does not depend on how busy the machine is;
    tests/model/test_kernels.py covers the calibration itself."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            select,
            "MatmulCalibration",
            lambda fixed_rows=None: MatmulCalibration(
                PACKED_MAX_ROWS if fixed_rows is None else fixed_rows
            ),
        )
        yield
