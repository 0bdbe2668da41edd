"""Weight formats: how a linear layer's weight is held in memory and multiplied.

A `Linear` holds its checkpoint weight as a parameter for loading, and once the model is loaded
the backend gives it a `LinearWeight` (model/backends/): the object its forward calls. A format
knows its bytes, its matmul (for few rows, where the weight's bytes are the cost, and for many,
where the arithmetic is) and the float weight it stands for (its reference), so every format
can be tested against `DenseWeight` on the same numbers. Formats know nothing of models or
checkpoints.
"""

from octavo.model.formats.base import DenseWeight, LinearWeight

__all__ = ["DenseWeight", "LinearWeight"]
