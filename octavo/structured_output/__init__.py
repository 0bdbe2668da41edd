"""Structured outputs enforced while sampling, through llguidance.

An engine-level package: the engine holds a StructuredOutputManager, the InputProcessor asks it
to validate constraints before admission, each request gets a GuidanceGrammar (the core's
`RequestGrammar`), and each step the manager turns the sampling requests' grammars into a token
bitmask that the runner applies to the logits. Imports no torch.
"""

from __future__ import annotations

from octavo.structured_output.backend import GuidanceBackend
from octavo.structured_output.grammar import GuidanceGrammar
from octavo.structured_output.manager import StructuredOutputManager

__all__ = ["GuidanceBackend", "GuidanceGrammar", "StructuredOutputManager"]
