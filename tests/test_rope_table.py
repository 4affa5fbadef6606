"""Decode's rope rows (engine/arch/rope.py RopeTable): the same bits as rope_cos_sin of the position alone."""

import pytest
import torch

from engine.arch.rope import RopeTable, rope_cos_sin


@pytest.mark.parametrize("D,scale,dtype", [(64, 1.0, torch.bfloat16), (128, 1.2, torch.bfloat16), (32, 1.0, torch.float32)])
def test_rows_match_a_position_computed_alone(D, scale, dtype):
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    table = RopeTable(inv_freq, scale, dtype)
    for pos in (0, 1, 37, table.block - 1, table.block, 3 * table.block + 5):  # block edges included
        cos, sin = table.row(pos)
        ref_cos, ref_sin = rope_cos_sin(inv_freq, scale, torch.tensor([pos]), dtype)
        assert cos.shape == (1, D) and cos.is_contiguous() and cos.dtype == dtype
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert len(table._blocks) == 3  # blocks 0, 1, 3: computed once, on first use
