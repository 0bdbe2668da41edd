"""The dependency direction of DESIGN.md, checked on every module's imports (AST, no import).

entrypoints -> engine -> {core, worker}; worker -> {model, sample}; core imports no torch and
nothing above it; nothing imports entrypoints.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "octavo"

# package -> octavo packages it may import (besides itself and octavo.config)
ALLOWED = {
    "core": {"metrics.stats"},
    "worker": {
        "model",
        "sample",
        "core.scheduler_output",
        "core.outputs",
        "core.sampling_params",
        "core.pooling_params",
    },
    "model": set(),
    "sample": set(),
    # FinishReason is the request's (core/request.py); metrics names outcomes by it.
    "metrics": {"core.request"},
    "engine": {"core", "worker", "metrics", "structured_output"},
    "structured_output": {"core"},
    "entrypoints": {"engine", "core", "metrics", "bench", "entrypoints"},
    "bench": {"entrypoints", "core", "config"},
}
NO_TORCH = {"core", "metrics", "structured_output"}


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if len(parts) > 1:
            yield parts[0], path


@pytest.mark.parametrize("package,path", list(_modules()), ids=lambda v: str(v))
def test_imports_follow_the_design(package: str, path: pathlib.Path) -> None:
    allowed = ALLOWED[package]
    for name in _imports(path):
        top = name.split(".")[0]
        if package in NO_TORCH and path.stem != "prometheus":
            assert top != "torch", f"{path.name} in {package} imports torch"
        if top != "octavo" or name in ("octavo", "octavo.config"):
            continue
        target = name.removeprefix("octavo.")
        if target.split(".")[0] == package:
            continue
        assert any(target == a or target.startswith(a + ".") for a in allowed), (
            f"{package}/{path.name} imports {name}, outside {sorted(allowed)}"
        )
        assert not target.startswith("entrypoints") or package in ("entrypoints", "bench"), (
            f"{path.name} imports {name}: nothing imports entrypoints"
        )
