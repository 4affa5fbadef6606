"""A quantized KV cache (kv_dtype int8 or fp8): one byte per cached number plus one scale per vector.

Granularity: one fp32 scale per token per head, i.e. per row of the cache's last axis (a head's
D keys or D values; for MLA, one token's latent, rope key or indexer key). Why per token and
not per block of tokens:
  - the cache is append-only and decode writes one position at a time; a token's scale is fixed
    when it is written, so nothing cached is ever re-quantized (a per-block scale either grows
    as the block fills, re-quantizing its earlier tokens, or must be chosen before their values
    are known);
  - keys differ in magnitude from token to token (the first token and other attention sinks
    are outliers); a per-token scale keeps one outlier from flattening its neighbours' codes.
The price is SCALE_BYTES per row: 3% of the codes at D = 128, more on tiny test models.

Which attention kinds have it: standard multi-head / grouped-query attention (KVCache in
engine/arch/layers.py) and MLA's latent cache (engine/arch/mla.py). gpt_oss's windowed sink attention
keeps bf16 (its cache is a ring; `supports_quantized_kv` says no, and the plan refuses it).

Shape legend: rows [..., L]: any leading axes (heads, positions), L numbers per row.
"""

from __future__ import annotations

import torch

from engine.base.dtypes import short_dtypes
from engine.base.errors import ConfigError

# kv_dtype name → (code dtype, largest code magnitude). fp8 is OCP e4m3 (448 its largest finite value).
KV_QUANT = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
SCALE_BYTES = 4  # one fp32 scale per row


def is_quantized(kv_dtype) -> bool:
    return isinstance(kv_dtype, str) and kv_dtype in KV_QUANT


class QuantizedRows:
    """A [..., L] cache tensor held as codes plus one scale per row.

    It stands where the caches hold a plain tensor, with the operations the attention code uses:
    `.shape`, `rows[index] = values` (quantizes), and `rows[index]` (a dequantized tensor in the
    compute dtype). `index` selects along the leading axes only, never inside a row.
    """

    def __init__(self, shape: tuple[int, ...], kind: str, dtype: torch.dtype):
        code_dtype, self.qmax = KV_QUANT[kind]
        self.kind = kind
        self.codes = torch.zeros(shape, dtype=code_dtype)
        self.scales = torch.zeros(shape[:-1], dtype=torch.float32)
        self.dtype = dtype  # what reads return: the compute dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __setitem__(self, index, values: torch.Tensor) -> None:
        v = values.float()
        # An all-zero row would divide by zero: its scale is tiny, its codes 0, it reads back as 0.
        scale = v.abs().amax(dim=-1).clamp_min(1e-30) / self.qmax  # [...]
        scaled = v / scale.unsqueeze(-1)
        if self.kind == "int8":
            codes = scaled.round().clamp(-self.qmax, self.qmax).to(torch.int8)
        else:  # e4m3 rounds to nearest on the cast; |scaled| <= 448 by construction
            codes = scaled.clamp(-self.qmax, self.qmax).to(self.codes.dtype)
        self.codes[index] = codes
        self.scales[index] = scale

    def __getitem__(self, index) -> torch.Tensor:
        return (self.codes[index].float() * self.scales[index].unsqueeze(-1)).to(self.dtype)


def kv_buffer(shape: tuple[int, ...], kv_dtype, compute_dtype: torch.dtype):
    """One cache tensor: plain zeros in a float kv_dtype, or QuantizedRows for int8 / fp8."""
    if is_quantized(kv_dtype):
        return QuantizedRows(shape, kv_dtype, compute_dtype)
    return torch.zeros(shape, dtype=kv_dtype)


def cache_bytes(elems: int, rows: int, kv_dtype) -> int:
    """Bytes of `elems` cached numbers in `rows` rows: codes and scales, or elems x the float size."""
    if is_quantized(kv_dtype):
        return elems + rows * SCALE_BYTES
    return elems * (torch.finfo(kv_dtype).bits // 8)


def kv_storage(name: str, compute_dtype: torch.dtype):
    """EngineConfig.kv_dtype → what the caches store: a torch float dtype, or 'int8' / 'fp8'."""
    if name == "auto":
        return compute_dtype
    if name in KV_QUANT:
        return name
    return short_dtypes()[name]


def supports_quantized_kv(args) -> bool:
    """Whether this architecture's attention cache has an int8 / fp8 form (see the module doc)."""
    impl = args.attention_impl
    return impl is None or hasattr(impl, "quantized_cache")


def check_kv_dtype(args, kv_dtype) -> None:
    if is_quantized(kv_dtype) and not supports_quantized_kv(args):
        raise ConfigError(f"kv_dtype {kv_dtype}: {args.model_type}'s attention cache has no quantized form "
                          f"(int8/fp8 KV works with standard multi-head/grouped-query attention and MLA)")
