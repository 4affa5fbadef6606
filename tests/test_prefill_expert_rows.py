"""A prefill's routed expert with few rows (engine/arch/layers.py swiglu_expert, NATIVE_EXPERT_ROWS):
bf16 experts of up to NATIVE_EXPERT_ROWS rows go through the native multi-row kernel, so each row
gets the one-row (decode) call's bits whatever rows come with it, within bf16 rounding of torch's
GEMM; above the threshold torch's GEMM itself, bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.arch.layers import NATIVE_EXPERT_ROWS, swiglu_expert
from colibri_native_cases import rand_bf16
from colibri_requirements import needs

WHY_NOT = native.load()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=needs("native", f"native kernels: {WHY_NOT}"))

H, I = 320, 136  # not multiples of the kernels' blocks; torch's GEMM and the one-row op round differently here


def _torch_gemm(x, weights):
    if len(weights) == 3:
        gate, up, down = weights
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    gate_up, down = weights
    gu = F.linear(x, gate_up)
    return F.linear(F.silu(gu[:, :I]) * gu[:, I:], down)


@pytest.mark.parametrize("per_expert", [2, 3])
def test_an_expert_of_few_rows_gives_each_row_its_one_row_bits_and_many_rows_take_torch(per_expert):
    gate, up, down = rand_bf16(I, H, seed=1, scale=0.1), rand_bf16(I, H, seed=2, scale=0.1), rand_bf16(H, I, seed=3)
    weights = (torch.cat([gate, up]), down) if per_expert == 2 else (gate, up, down)
    x = rand_bf16(NATIVE_EXPERT_ROWS + 1, H, seed=4)
    assert NATIVE_EXPERT_ROWS >= 12  # a short prompt's experts (~9 rows each for 64 tokens on demo) take it
    for rows in (2, 5, 12, NATIVE_EXPERT_ROWS):
        y = swiglu_expert(x[:rows], weights)
        for r in range(rows):
            assert torch.equal(y[r:r + 1], swiglu_expert(x[r:r + 1], weights))  # row-independent
        torch.testing.assert_close(y.float(), _torch_gemm(x[:rows], weights).float(), rtol=2e-2, atol=2e-2)
    many = x[:NATIVE_EXPERT_ROWS + 1]
    assert torch.equal(swiglu_expert(many, weights), _torch_gemm(many, weights))
