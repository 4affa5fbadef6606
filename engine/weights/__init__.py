"""Weight operators: what the forward pass multiplies by, whatever the weight's format on disk.

    stored.py     the StoredMatrix contract (device, bytes, a copy on another device) and
                  `linear(x, w, bias)`: x @ w.T for a plain tensor or any stored matrix
    quantized.py  int8 per row and int4 group-wise: quantize / dequantize, the stored int4 layout
                  and engine/native's strips, which kernel applies, QuantWeight
    fp8.py        FP8 e4m3 block-scaled: dequantize / quantize, Fp8Weight
    mxfp4.py      MXFP4 (gpt-oss's experts): dequantize / quantize, Mxfp4Matrix, fused_kernel_available

What a file says is engine/format's: which tensors a checkpoint stores how, config.json's
quantization_config and the checks on both (container.py for our int8/int4 containers,
fp8_checkpoint.py for published FP8, layout.py for each expert's bytes, MXFP4's included).
engine/arch computes with these operators, engine/format builds them from what it reads; neither
needs the other for that.

The Python wrappers of the native ops stay in engine.native (linear, int8_linear, int4_linear,
mxfp4_linear, fp8_linear): the kernels are one library with one `load()` and one `ready`, and
the same module wraps the fused MoE, attention and decode-step ops, which are not weight
operators; a wrapper is its op's signature, kept beside the C++ that registers it. The operators
here decide when a kernel applies and fall back to torch where it does not (FP8's wrapper is
native.fp8_linear, and Fp8Weight reads native.ready as Mxfp4Matrix does: one library, one load).

Owns: a weight as a linear operator, and the quantization math behind it.
May import: engine.base, engine.native.
"""
