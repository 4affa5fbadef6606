"""The native fused MXFP4 matrix-vector kernel (engine/native/mxfp4_decode.cpp) against its torch
reference (dequantize with engine.weights.mxfp4.mxfp4_dequantize, then F.linear), and the torch
fallback of Mxfp4Matrix when the native kernels are off.

Tolerance: fp32 sums in another order than torch's matmul: |difference| <= 1e-5 of the sum of
|products| of the row (the bound of reordered fp32 sums at these lengths is ~K * 2^-24).
bf16 outputs: the kernel rounds its fp32 sum once, torch rounds its own: at most one bf16
step apart (2^-7 relative), checked against the fp32 reference.
"""

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.weights.mxfp4 import Mxfp4Matrix, mxfp4_dequantize

# (rows of x, output rows N, blocks per row G): one block, odd N (not a multiple of the threads'
# grain of 16), more rows of x than one group of four shares, a gpt-oss-sized row.
SHAPES = [(1, 1, 1), (1, 70, 5), (3, 33, 7), (5, 17, 1), (9, 40, 3), (1, 19, 90)]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    why = native.load()
    if why is not None:
        pytest.skip(f"native kernels unavailable: {why}")


def _case(M, N, G, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (N, G, 16), dtype=torch.uint8, generator=gen)
    # exponents around 127 so sums stay finite; every byte value 0..255 appears in the codes
    scales = torch.randint(112, 140, (N, G), dtype=torch.uint8, generator=gen)
    x = torch.randn(M, G * 32, generator=gen)
    bias = torch.randn(N, generator=gen)
    return x, blocks, scales, bias


def _bound(x, w):
    return (x.abs() @ w.abs().t()) * 1e-5 + 1e-30


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_bias", [True, False])
def test_fp32_equals_the_torch_reference(shape, with_bias):
    x, blocks, scales, bias = _case(*shape)
    bias = bias if with_bias else None
    w = mxfp4_dequantize(blocks, scales, torch.float32)
    reference = F.linear(x, w, bias)
    ours = native.mxfp4_linear(x, blocks, scales, bias)
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    assert ((ours - reference).abs() <= _bound(x, w)).all()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_is_the_fp32_sum_rounded_once(shape):
    x, blocks, scales, bias = _case(*shape, seed=1)
    xb, bb = x.bfloat16(), bias.bfloat16()
    exact = F.linear(xb.float(), mxfp4_dequantize(blocks, scales, torch.float32), bb.float())
    ours = native.mxfp4_linear(xb, blocks, scales, bb)
    assert ours.dtype == torch.bfloat16
    assert ((ours.float() - exact).abs() <= exact.abs() * 2 ** -8 + _bound(xb.float(), mxfp4_dequantize(
        blocks, scales, torch.float32))).all()
    torch_bf16 = F.linear(xb, mxfp4_dequantize(blocks, scales, torch.bfloat16), bb)
    assert ((ours.float() - torch_bf16.float()).abs() <= torch_bf16.float().abs() * 2 ** -7 + 1e-3).all()


def test_extreme_exponents_match_the_reference():
    """Subnormal (2^-127 .. 2^-125) and huge (2^123) block scales: the products are exact either way."""
    N, G = 4, 3
    blocks = torch.arange(N * G * 16, dtype=torch.int64).remainder(256).to(torch.uint8).view(N, G, 16)
    scales = torch.tensor([[0, 1, 2], [127, 128, 126], [250, 240, 230], [0, 200, 127]], dtype=torch.uint8)
    x = torch.ones(1, G * 32) * 2.0 ** -20
    reference = F.linear(x, mxfp4_dequantize(blocks, scales, torch.float32))
    ours = native.mxfp4_linear(x, blocks, scales, None)
    assert torch.allclose(ours, reference, rtol=1e-6, atol=0.0)


def test_a_row_does_not_depend_on_the_threads_or_the_other_rows():
    """What the placement-invariance tests rely on: an expert computed alone or among others,
    on 1 thread or several, gives the same bits."""
    x, blocks, scales, bias = _case(7, 53, 9, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.mxfp4_linear(x, blocks, scales, bias)
        torch.set_num_threads(2)
        two = native.mxfp4_linear(x, blocks, scales, bias)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    for m in range(x.shape[0]):
        assert torch.equal(native.mxfp4_linear(x[m:m + 1], blocks, scales, bias)[0], one[m])


def test_bad_shapes_are_refused():
    x, blocks, scales, bias = _case(1, 8, 2)
    with pytest.raises(RuntimeError, match="columns"):
        native.mxfp4_linear(x[:, :32], blocks, scales, bias)
    with pytest.raises(RuntimeError, match="scales must be"):
        native.mxfp4_linear(x, blocks, scales[:, :1].contiguous(), bias)
    with pytest.raises(RuntimeError, match="bias must be"):
        native.mxfp4_linear(x, blocks, scales, bias[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matrix_uses_the_kernel_and_falls_back_to_torch(dtype, monkeypatch):
    x, blocks, scales, bias = _case(2, 24, 4, seed=3)
    x, bias = x.to(dtype), bias.to(dtype)
    matrix = Mxfp4Matrix(blocks, scales)
    assert torch.equal(matrix.linear(x, bias), native.mxfp4_linear(x, blocks, scales, bias))
    monkeypatch.setattr(native, "ready", False)  # as with COLIBRI_NATIVE=0: dequantize, then F.linear
    assert torch.equal(matrix.linear(x, bias), F.linear(x, mxfp4_dequantize(blocks, scales, dtype), bias))
    assert matrix.nbytes == blocks.nbytes + scales.nbytes
