"""Where each routed expert's bytes are, and how to turn those bytes back into tensors.

Three on-disk layouts:
- per-expert tensors (what `save_pretrained` writes): gate, up and down are three tensors,
  usually adjacent in one shard, so one read covers the expert;
- fused 3-D tensors: gate_up_proj [E, 2I, H] and down_proj [E, H, I]; expert e is a
  contiguous slice of each, so two reads;
- FP8 block-scaled (engine/format/fp8_checkpoint.py): per-expert tensors plus a `weight_scale_inv` beside each
  weight. safetensors writers order a shard's data by dtype then name, so an expert's three F32
  scales sit together and its three F8 weights together: two spans (one when a writer keeps
  them adjacent), each read whole.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from engine.format.checkpoint import Checkpoint, TensorInfo
from engine.format.container import QuantSpec, check_quantized, container_spec
from engine.base.align import align_up, direct_window_bytes
from engine.base.errors import ModelFormatError
from engine.arch.args import ModelArgs, expert_tensor_names, fused_expert_tensor_names
from engine.arch.gpt_oss_layers import GptOssExperts
from engine.weights import mxfp4
from engine.weights.mxfp4 import MX_BLOCK, MXFP4_DEQUANT, MXFP4_FUSED, Mxfp4Matrix, mxfp4_dequantize
from engine.weights.quantized import QuantWeight, int4_strips_on
from engine.weights.fp8 import Fp8Weight
from engine.format.fp8_checkpoint import SCALE_SUFFIX, Fp8Spec, check_fp8, fp8_spec

# Gaps up to this size between an expert's tensors are read through rather than split into
# two requests (safetensors may pad for alignment).
MAX_GAP = 4096

# mmap-mode buffers are read-only views of the page cache; we never write to weights, so
# torch's warning about non-writable buffers is noise.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


@dataclass(frozen=True)
class Span:
    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class Piece:
    """One matrix inside a span's buffer."""

    span: int  # index into ExpertLocation.spans
    start: int  # byte offset inside that span's buffer
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.finfo(self.dtype).bits // 8 if self.dtype.is_floating_point else torch.iinfo(self.dtype).bits // 8
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ExpertLocation:
    spans: tuple[Span, ...]
    # gate [I,H], up [I,H], down [H,I]; quantized: (qweight, qscale) of each; or what `decode` reads
    pieces: tuple[Piece, ...]
    # (location, span buffers, dtype) → the expert's tensors, for layouts that are not three
    # plain matrices (gpt_oss: fused with biases, or MXFP4 blocks dequantized on read).
    decode: Callable | None = None
    quant: QuantSpec | None = None  # a colibri int8/int4 container (engine/format/container.py)
    fp8: Fp8Spec | None = None  # a published FP8 block-scaled checkpoint: (weight, scale_inv) pairs
    # Formats that `decode` keeps as stored (gpt_oss MXFP4 for its native kernel): per piece,
    # True where the compute reads the bytes in place, False where they become the compute dtype.
    stored: tuple[bool, ...] | None = None
    kernel: str | None = None  # the experts' matmul, where `decode` picks its own
    names: tuple[str, ...] | None = None  # FP8: the weights' tensor names, for a value error to name

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.spans)


class ExpertLayout:
    def __init__(self, checkpoint: Checkpoint, args: ModelArgs):
        self.args = args
        self.ckpt = checkpoint
        self.quant = container_spec(checkpoint)
        self.fp8 = fp8_spec(checkpoint.config, f"{checkpoint.directory}/config.json")
        self._locations: dict[tuple[int, int], ExpertLocation] = {}
        self._slot_bytes: dict[bool, int] = {}
        for layer in range(args.num_layers):
            if not args.is_moe_layer(layer):
                continue
            if isinstance(args.expert_impl, GptOssExperts):  # fused with biases, plain or MXFP4
                self._locations.update(gpt_oss_locations(args.expert_impl, checkpoint, layer))
                continue
            if self.quant is not None or self.fp8 is not None:
                located = self._quantized if self.quant is not None else self._fp8
                for e in range(args.num_experts):
                    self._locations[(layer, e)] = located(expert_tensor_names(args, layer, e))
                continue
            fused = fused_expert_tensor_names(args, layer)
            if fused[0] in checkpoint and fused[1] in checkpoint:
                self._add_fused(layer, *(checkpoint.info(n) for n in fused))
            else:
                for e in range(args.num_experts):
                    infos = [checkpoint.info(n) for n in expert_tensor_names(args, layer, e)]
                    self._locations[(layer, e)] = self._per_expert(infos)

    def _per_expert(self, infos: list[TensorInfo]) -> ExpertLocation:
        a = self.args
        expected = [(a.moe_intermediate_size, a.hidden_size)] * 2 + [(a.hidden_size, a.moe_intermediate_size)]
        for info, shape in zip(infos, expected):
            if info.shape != shape:
                raise ModelFormatError(f"{info.path}: tensor {info.name!r} has shape {list(info.shape)}, "
                                       f"config.json implies {list(shape)}")
        spans, pieces = group_into_spans(infos)
        return ExpertLocation(tuple(spans), tuple(pieces))  # type: ignore[arg-type]

    def _quantized(self, names) -> ExpertLocation:
        a = self.args
        shapes = [(a.moe_intermediate_size, a.hidden_size)] * 2 + [(a.hidden_size, a.moe_intermediate_size)]
        infos = [info for name, shape in zip(names, shapes) for info in check_quantized(self.ckpt, self.quant, name, shape)]
        spans, pieces = group_into_spans(infos)
        return ExpertLocation(tuple(spans), tuple(pieces), quant=self.quant)

    def _fp8(self, names) -> ExpertLocation:
        a = self.args
        shapes = [(a.moe_intermediate_size, a.hidden_size)] * 2 + [(a.hidden_size, a.moe_intermediate_size)]
        infos = [info for name, shape in zip(names, shapes) for info in check_fp8(self.ckpt, self.fp8, name, shape)]
        spans, pieces = group_into_spans(infos)
        return ExpertLocation(tuple(spans), tuple(pieces), fp8=self.fp8, names=tuple(names))

    def _add_fused(self, layer: int, gate_up: TensorInfo, down: TensorInfo) -> None:
        a = self.args
        E, I, H = a.num_experts, a.moe_intermediate_size, a.hidden_size
        if gate_up.shape != (E, 2 * I, H) or down.shape != (E, H, I):
            raise ModelFormatError(
                f"{gate_up.path}: fused experts of layer {layer} have shapes {list(gate_up.shape)} and "
                f"{list(down.shape)}, config.json implies {[E, 2 * I, H]} and {[E, H, I]}")
        gu_bytes, d_bytes = gate_up.nbytes // E, down.nbytes // E
        half = gu_bytes // 2
        for e in range(E):
            spans = (Span(gate_up.path, gate_up.offset + e * gu_bytes, gu_bytes),
                     Span(down.path, down.offset + e * d_bytes, d_bytes))
            pieces = (Piece(0, 0, gate_up.torch_dtype, (I, H)), Piece(0, half, gate_up.torch_dtype, (I, H)),
                      Piece(1, 0, down.torch_dtype, (H, I)))
            self._locations[(layer, e)] = ExpertLocation(spans, pieces)

    def location(self, layer: int, expert: int) -> ExpertLocation:
        return self._locations[(layer, expert)]

    @property
    def expert_nbytes(self) -> int:
        """On-disk bytes of one expert (all experts have the same geometry)."""
        return next(iter(self._locations.values())).nbytes if self._locations else 0

    @property
    def kernel(self) -> str | None:
        """The experts' matmul when the layout's format picks one (gpt_oss MXFP4), else None."""
        return next(iter(self._locations.values())).kernel if self._locations else None

    @property
    def spans_per_expert(self) -> int:
        """Read requests per expert (1 per-expert, 2 fused, 4-6 gpt_oss): each may need alignment slack."""
        return max((len(loc.spans) for loc in self._locations.values()), default=1)

    @property
    def num_routed(self) -> int:
        return len(self._locations)

    # What the memory plan asks of a layout (the cost model's stand-in layouts answer the same).
    def zero_copy(self, dtype: torch.dtype) -> bool:
        return zero_copy(self, dtype)

    def slot_bytes(self, direct: bool) -> int:
        # A walk over every expert (DeepSeek-V3: 14,848), asked once per config the cost model
        # plans (thousands): the locations never change, so once per io kind.
        if direct not in self._slot_bytes:
            self._slot_bytes[direct] = slot_bytes(self, direct)
        return self._slot_bytes[direct]

    def keys(self):
        return self._locations.keys()


def group_into_spans(infos: list[TensorInfo]) -> tuple[list[Span], list[Piece]]:
    """Tensors → as few read requests as possible, and where each tensor sits in them.

    Tensors in one file with at most MAX_GAP bytes between them merge into one span; pieces
    come back in the order of `infos`.
    """
    order = sorted(range(len(infos)), key=lambda i: (infos[i].path, infos[i].offset))
    spans: list[Span] = []
    at: dict[int, tuple[int, int]] = {}
    for i in order:
        info = infos[i]
        last = spans[-1] if spans else None
        if last and last.path == info.path and 0 <= info.offset - (last.offset + last.length) <= MAX_GAP:
            spans[-1] = Span(last.path, last.offset, info.end - last.offset)
        else:
            spans.append(Span(info.path, info.offset, info.nbytes))
        at[i] = (len(spans) - 1, info.offset - spans[-1].offset)
    return spans, [Piece(at[i][0], at[i][1], infos[i].torch_dtype, infos[i].shape) for i in range(len(infos))]


def piece_tensor(buffers: list, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
    """One tensor out of the span buffers: a zero-copy view, or a cast copy if dtypes differ."""
    raw = torch.frombuffer(buffers[piece.span], dtype=torch.uint8, count=piece.nbytes, offset=piece.start)
    t = raw.view(piece.dtype).view(piece.shape)
    return t if t.dtype == dtype else t.to(dtype)


def joined_pair(buffers: list, codes: Piece, scales: Piece) -> torch.Tensor | None:
    """uint8 over a quantized matrix's codes and scales where the scales follow the codes in one
    writable buffer (convert writes them so): the int4 strips are repacked there, in place. None
    for a read-only buffer (mmap io_mode) or pieces apart."""
    buf = buffers[codes.span]
    if scales.span != codes.span or scales.start != codes.start + codes.nbytes or memoryview(buf).readonly:
        return None
    return torch.frombuffer(buf, dtype=torch.uint8, count=codes.nbytes + scales.nbytes, offset=codes.start)


def tensors_from_buffers(loc: ExpertLocation, buffers: list, dtype: torch.dtype):
    """Span buffers (bytes-like, one per span) → the expert's weights in the compute dtype:
    (gate_up [2I,H], down [H,I]) where gate and up are adjacent in one span (both HF layouts
    write them so: one matmul instead of two), else (gate [I,H], up [I,H], down [H,I]).

    This is the one bytes → expert step: the store calls it once per read, the model's expert
    function (model.swiglu_expert) reads what it returns, and a new container format
    (quantized, biased) replaces the pair. Same dtype is a zero-copy view of the buffer, so the
    buffer (the store's slot) lives as long as the tensors do; casting (bf16 on disk, fp32
    compute) copies. Quantized experts come back as three QuantWeights (engine/weights/quantized.py) whose
    codes are views of the buffer too.
    """
    if loc.decode is not None:
        return loc.decode(loc, buffers, dtype)
    if loc.fp8 is not None:  # codes stay views of the buffer; scales (a few hundred bytes) are checked
        names = loc.names or ("gate", "up", "down")
        return tuple(Fp8Weight.from_stored(piece_tensor(buffers, w, w.dtype), piece_tensor(buffers, s, s.dtype),
                                           loc.fp8.block, f"{loc.spans[s.span].path}: {name + SCALE_SUFFIX!r}",
                                           f"{loc.spans[w.span].path}: {name!r}")
                     for name, (w, s) in zip(names, zip(loc.pieces[0::2], loc.pieces[1::2])))
    if loc.quant is not None:
        q = loc.quant
        return tuple(QuantWeight.prepare(piece_tensor(buffers, w, w.dtype), piece_tensor(buffers, s, s.dtype),
                                         q.quant, q.group_size, dtype, joined=joined_pair(buffers, w, s))
                     for w, s in zip(loc.pieces[0::2], loc.pieces[1::2]))
    gate, up, down = loc.pieces
    if (gate.span == up.span and up.start == gate.start + gate.nbytes and gate.dtype == up.dtype
            and gate.shape == up.shape):
        fused = Piece(gate.span, gate.start, gate.dtype, (2 * gate.shape[0], *gate.shape[1:]))
        return piece_tensor(buffers, fused, dtype), piece_tensor(buffers, down, dtype)
    return tuple(piece_tensor(buffers, piece, dtype) for piece in loc.pieces)


def expert_memory_bytes(layout: "ExpertLayout", dtype: torch.dtype) -> int:
    """RAM one routed expert takes once decoded for compute: what the cache and the plan count.

    Plain experts: three matrices in the compute dtype. Quantized: the codes as stored, and
    scales in the compute dtype (the kernels take them in the activations' dtype)."""
    if not layout.num_routed:
        return 0
    loc = next(iter(layout._locations.values()))
    if getattr(loc, "fp8", None) is not None:  # codes as stored, scales in fp32
        return sum(w.nbytes + s.nbytes // s.dtype.itemsize * 4 for w, s in zip(loc.pieces[0::2], loc.pieces[1::2]))
    stored = getattr(loc, "stored", None)  # the cost model's stand-in layouts have none
    if stored is not None:
        return sum(p.nbytes if kept else _numel(p) * (torch.finfo(dtype).bits // 8) for p, kept in zip(loc.pieces, stored))
    if loc.quant is None:  # every weight of the expert (gpt_oss: biases too) in the compute dtype
        return layout.args.expert_numel * (torch.finfo(dtype).bits // 8)
    if loc.quant.quant == "int4" and int4_strips_on():  # the strips: as stored, bf16 scales inside
        return sum(p.nbytes for p in loc.pieces)
    elem = torch.finfo(dtype).bits // 8
    return sum(w.nbytes + s.nbytes // s.dtype.itemsize * elem for w, s in zip(loc.pieces[0::2], loc.pieces[1::2]))


def cast_bytes(layout: "ExpertLayout", dtype: torch.dtype) -> int:
    """Bytes of a zero-copy expert that are copies all the same: a quantized expert's scales
    cast to a compute dtype other than the stored bf16 (its codes stay views of the slot)."""
    if not layout.num_routed:
        return 0
    loc = next(iter(layout._locations.values()))
    if getattr(loc, "fp8", None) is not None:  # bf16-stored scales become fp32 copies
        return sum(s.nbytes // s.dtype.itemsize * 4 for s in loc.pieces[1::2] if s.dtype != torch.float32)
    stored = getattr(loc, "stored", None)  # the cost model's stand-in layouts have none
    if stored is not None:
        return sum(_numel(p) * (torch.finfo(dtype).bits // 8) for p, kept in zip(loc.pieces, stored)
                   if not kept and p.dtype != dtype)
    if loc.quant is None or (loc.quant.quant == "int4" and int4_strips_on()):  # strips: repacked in the slot
        return 0
    scales = [s for s in loc.pieces[1::2] if s.dtype != dtype]
    return sum(s.nbytes // s.dtype.itemsize * (torch.finfo(dtype).bits // 8) for s in scales)


def zero_copy(layout: ExpertLayout, dtype: torch.dtype) -> bool:
    """Whether the compute tensors are views of the read bytes, so a cached expert holds its slot.
    Always so for quantized experts (their codes are never copied)."""
    if not layout.num_routed:
        return False
    loc = next(iter(layout._locations.values()))
    return (loc.quant is not None or getattr(loc, "stored", None) is not None
            or getattr(loc, "fp8", None) is not None or all(p.dtype == dtype for p in loc.pieces))


def _numel(piece: Piece) -> int:
    n = 1
    for d in piece.shape:
        n *= d
    return n


def slot_bytes(layout: ExpertLayout, direct: bool) -> int:
    """Bytes one expert's read needs: each span page-aligned in the slot, widened for O_DIRECT."""
    worst = 0
    for loc in layout._locations.values():
        need = sum(align_up(direct_window_bytes(s.offset, s.length) if direct else s.length) for s in loc.spans)
        worst = max(worst, need)
    return worst


# --- gpt_oss: fused experts with biases, plain or MXFP4 (engine/weights/mxfp4.py has the MXFP4 math) ----

def _slice(info: TensorInfo, e: int, E: int, shape: tuple[int, ...]) -> TensorInfo:
    """Expert e's slice of a fused [E, ...] tensor, as a TensorInfo of its own."""
    step = info.nbytes // E
    return TensorInfo(f"{info.name}[{e}]", info.path, info.dtype, shape, info.offset + e * step, step)


def gpt_oss_locations(experts: GptOssExperts, ckpt: Checkpoint, layer: int) -> dict:
    """(layer, expert) → ExpertLocation of one layer's fused gpt_oss experts, in either storage."""
    base = f"model.layers.{layer}.mlp.experts"
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    mx = f"{base}.gate_up_proj_blocks" in ckpt
    if mx:
        expect = {"gate_up_proj_blocks": (E, 2 * I, H // MX_BLOCK, 16), "gate_up_proj_scales": (E, 2 * I, H // MX_BLOCK),
                  "gate_up_proj_bias": (E, 2 * I),
                  "down_proj_blocks": (E, H, I // MX_BLOCK, 16), "down_proj_scales": (E, H, I // MX_BLOCK),
                  "down_proj_bias": (E, H)}
    else:
        expect = {"gate_up_proj": (E, H, 2 * I), "gate_up_proj_bias": (E, 2 * I),
                  "down_proj": (E, I, H), "down_proj_bias": (E, H)}
    infos = {}
    for name, shape in expect.items():
        info = ckpt.info(f"{base}.{name}")
        if info.shape != shape:
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} has shape {list(info.shape)}, "
                                   f"config.json implies {list(shape)}")
        if name.endswith(("_blocks", "_scales")) and info.dtype != "U8":
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} is {info.dtype}, MXFP4 needs U8")
        infos[name] = info
    fused = mx and mxfp4.fused_kernel_available()  # through the module: benchmarks and tests switch it
    decode = (_decode_mxfp4_stored if fused else _decode_mxfp4) if mx else _decode_gpt_oss_plain
    # Fused: blocks and scales are computed on as stored, biases in the compute dtype.
    stored = tuple(name.endswith(("_blocks", "_scales")) for name in expect) if fused else None
    kernel = (MXFP4_FUSED if fused else MXFP4_DEQUANT) if mx else None
    out = {}
    for e in range(E):
        spans, pieces = group_into_spans([_slice(i, e, E, s[1:]) for i, s in zip(infos.values(), expect.values())])
        out[(layer, e)] = ExpertLocation(tuple(spans), tuple(pieces), decode=decode, stored=stored, kernel=kernel)
    return out


def _decode_gpt_oss_plain(loc, buffers, dtype):
    gate_up, gate_up_bias, down, down_bias = (piece_tensor(buffers, p, dtype) for p in loc.pieces)
    # Stored as x @ W ([in, out]); the transposes are views in F.linear's [out, in] layout.
    return gate_up.t(), gate_up_bias, down.t(), down_bias


def _decode_mxfp4(loc, buffers, dtype):
    gu_blocks, gu_scales, gu_bias, d_blocks, d_scales, d_bias = (
        piece_tensor(buffers, p, p.dtype) for p in loc.pieces)
    # Copies, never views: this layout is not zero-copy (the plan gives the store read slots
    # only, no slot per cache entry), so a cached expert holding a view of its slot (a bias
    # already in the compute dtype: `.to` returns it as is) pinned it, and once the cache had
    # taken every slot each read waited out the store's slot guard (5 s): the "hang" of the
    # dequantize path streamed on gpt-oss-small.
    return (mxfp4_dequantize(gu_blocks, gu_scales, dtype), gu_bias.to(dtype, copy=True),
            mxfp4_dequantize(d_blocks, d_scales, dtype), d_bias.to(dtype, copy=True))


def _decode_mxfp4_stored(loc, buffers, dtype):
    gu_blocks, gu_scales, gu_bias, d_blocks, d_scales, d_bias = (
        piece_tensor(buffers, p, p.dtype) for p in loc.pieces)
    return (Mxfp4Matrix(gu_blocks, gu_scales), gu_bias.to(dtype), Mxfp4Matrix(d_blocks, d_scales), d_bias.to(dtype))
