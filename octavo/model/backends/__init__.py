"""Model backends: the attention backend, the layer ops, the weight formats, the sampler's draw
and the fused paths a model runs with, chosen once by `select_backend` (select.py).

base.py has the interfaces; torch_ops.py and reference.py the plain-torch references; sdpa.py
attention through torch's SDPA; cpu.py the CPU kernels' ops and paged attention. The model's
layers receive their ops when the model is built and never ask again which one runs.
"""

from octavo.model.backends.select import ATTENTION_BACKENDS, ModelBackend, select_backend

__all__ = ["ATTENTION_BACKENDS", "ModelBackend", "select_backend"]
