"""Weight operators: a stored matrix the forward pass multiplies by, whatever its format on disk:
bf16 tensors, int8 / int4 group-wise containers (quantized), FP8 e4m3 with block scales (fp8), and the
math each format's kernels compute (engine/native has the C++).

Owns: a weight as a linear operator, and the quantization math behind it.
May import: engine.base, engine.native.
"""
