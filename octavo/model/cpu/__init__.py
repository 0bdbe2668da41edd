"""The C++ kernels of octavo's CPU backend (csrc/) and their Python side, by subject:

- build.py: compiling and loading the library once (`load()`), the build's vector width;
- ops.py: one wrapper per operator, whose docstring is its contract;
- reference.py: the plain-torch versions the tests hold the kernels to;
- packing.py: the packed-panel weight layout the matmul kernel reads;
- calibration.py: timing the packed matmul against torch's GEMM per weight shape at load;
- fused.py: a whole decoder layer for decode rows as one call, opt-in per architecture;
- bench.py (`python -m octavo.model.cpu --bench`): the kernels against torch.

Importing this package loads nothing; model/backends/select.py decides whether the kernels run.
Knows nothing of requests: tensors in, tensors out.
"""
