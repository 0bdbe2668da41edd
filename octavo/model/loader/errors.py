"""ModelLoadError: the one exception a failed model load raises.

A leaf module so that every loader part can raise it without importing the others.
"""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A checkpoint could not be loaded; the message names the path and the problem (missing
    path, unsupported architecture or tensor type, truncated file, missing tensors)."""
