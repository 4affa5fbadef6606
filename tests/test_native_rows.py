"""The native decode kernels on several rows at once (batched decode: B sequences in one step, or a
speculative verify's positions): native.experts_rows / quant_experts_rows and linear / int8_linear /
int4_linear with M > 1 give every row the bits of the 1-row op on that row alone (rows never share an
accumulation), on odd shapes (H and I not multiples of 32 or 64), 1..7 rows, slots spread unevenly
over the experts (some with none, one with more than four), experts as (gate_up, down) and
(gate, up, down), int8 and int4 of each group; and they refuse slots they cannot serve."""

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.weights.quantized import QuantWeight, quantize
from colibri_native_cases import int8_native_on, needs_native_int, rand_bf16  # noqa: F401 (int8_native_on: a fixture)
from colibri_requirements import needs

WHY_NOT = native.load()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=needs("native", f"native kernels: {WHY_NOT}"))


def _slots(M: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of M rows routed to k distinct experts drawn with a skew (low ids favoured, some experts
    never chosen), then the slots sorted by expert (rows ascending within one): (slot_row, slot_expert)."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.linspace(3.0, 0.0, E)
    pairs = []
    for r in range(M):
        chosen = torch.multinomial(torch.softmax(bias, 0), min(k, E), replacement=False, generator=g)
        pairs += [(int(e), r) for e in chosen]
    pairs.sort()
    return (torch.tensor([r for _, r in pairs], dtype=torch.int64),
            torch.tensor([e for e, _ in pairs], dtype=torch.int64))


def _bf16_experts(E: int, H: int, I: int, per_expert: int, seed: int) -> list[tuple]:
    out = []
    for e in range(E):
        gate, up = rand_bf16(I, H, seed=seed + 3 * e, scale=0.1), rand_bf16(I, H, seed=seed + 3 * e + 1, scale=0.1)
        down = rand_bf16(H, I, seed=seed + 3 * e + 2, scale=0.1)
        out.append((torch.cat([gate, up]), down) if per_expert == 2 else (gate, up, down))
    return out


# (H, I, E, M, k, per_expert): H and I off the 32/64 blocks (masked tails), a 32-block with no 64
# (H = 96), rows 1..7, slots from 1 per row to every expert of a few.
@pytest.mark.parametrize("H,I,E,M,k,per_expert", [
    (100, 37, 9, 1, 3, 2), (100, 37, 9, 7, 3, 3), (96, 72, 5, 5, 2, 2), (130, 50, 4, 6, 4, 3),
    (64, 96, 12, 3, 8, 3), (33, 17, 3, 2, 1, 2), (256, 160, 16, 4, 4, 2)])
def test_experts_rows_give_each_slot_the_one_row_bits(H, I, E, M, k, per_expert):
    experts = _bf16_experts(E, H, I, per_expert, seed=H * I)
    weights = [t for ex in experts for t in ex]
    x = rand_bf16(M, H, seed=M + H)
    slot_row, slot_expert = _slots(M, E, k, seed=E + M)
    y = native.experts_rows(x, weights, per_expert, slot_row, slot_expert)
    assert y.shape == (len(slot_row), H) and y.dtype == torch.bfloat16
    for s, (r, e) in enumerate(zip(slot_row.tolist(), slot_expert.tolist())):
        alone = native.experts(x[r:r + 1], list(experts[e]), per_expert)
        assert torch.equal(y[s], alone[0]), (s, r, e)


def test_experts_rows_serve_one_expert_many_rows_and_skip_unused_experts():
    """Seven rows on one expert (passes of four, three, then alone), the other experts given but
    unused; a row may appear at several experts. S = 0 gives an empty result."""
    H, I = 100, 37
    experts = _bf16_experts(4, H, I, 3, seed=11)
    weights = [t for ex in experts for t in ex]
    x = rand_bf16(7, H, seed=12)
    slot_row = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6, 2], dtype=torch.int64)
    slot_expert = torch.tensor([2, 2, 2, 2, 2, 2, 2, 3, 3], dtype=torch.int64)
    y = native.experts_rows(x, weights, 3, slot_row, slot_expert)
    for s, (r, e) in enumerate(zip(slot_row.tolist(), slot_expert.tolist())):
        assert torch.equal(y[s], native.experts(x[r:r + 1], list(experts[e]), 3)[0])
    empty = torch.empty(0, dtype=torch.int64)
    assert native.experts_rows(x, weights, 3, empty, empty).shape == (0, H)


@pytest.mark.parametrize("slot_row,slot_expert,message", [
    ([0, 1], [1, 0], "sorted by expert"), ([0, 3], [0, 1], "not a row of x"), ([0, 1], [0, 2], "not one of the 2"),
    ([-1], [0], "not a row of x")])
def test_experts_rows_refuse_slots_they_cannot_serve(slot_row, slot_expert, message):
    experts = _bf16_experts(2, 64, 32, 2, seed=1)
    x = rand_bf16(3, 64, seed=2)
    with pytest.raises(RuntimeError, match=message):
        native.experts_rows(x, [t for ex in experts for t in ex], 2, torch.tensor(slot_row), torch.tensor(slot_expert))


# (520, 260): a matrix past PAIR_MAX_BYTES (256 KiB, bf16_kernels.h), one weight row a pass; the others two
@pytest.mark.parametrize("N,K", [(70, 100), (33, 96), (16, 257), (128, 64), (520, 260)])
def test_linear_rows_are_the_one_row_bits(N, K):
    w = rand_bf16(N, K, seed=N + K, scale=0.1)
    for M in range(1, 10):  # 9: two passes of four and one alone
        x = rand_bf16(M, K, seed=M)
        y = native.linear(x, w)
        assert y.shape == (M, N)
        for m in range(M):
            assert torch.equal(y[m], native.linear(x[m:m + 1], w)[0]), (M, m)
    bias = rand_bf16(1, N, seed=N, scale=1.0)[0]  # a verify's q/k/v projections (glm4_moe, qwen2_moe)
    x = rand_bf16(5, K, seed=K)
    y = native.linear(x, w, bias)
    for m in range(5):
        assert torch.equal(y[m], native.linear(x[m:m + 1], w, bias)[0]), m


@pytest.mark.parametrize("N,K", [(16, 256), (256, 100), (64, 7)])  # routers: 16 / 256 experts; ragged tails
def test_fp32_router_logits_match_torch_and_each_row_is_its_own(N, K):
    """The sigmoid routers' fp32 logits (native.linear_f32: bf16 weights widened in registers) agree
    with F.linear over an fp32 copy of the weights to fp32 rounding, and row m of an M-row call is the
    call with that row alone, bit for bit (a verify's rows route as each would alone)."""
    w = rand_bf16(N, K, seed=N, scale=0.1)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(K))
    y = native.linear_f32(x, w)
    assert y.dtype == torch.float32 and y.shape == (9, N)
    assert torch.allclose(y, F.linear(x, w.float()), rtol=1e-5, atol=1e-5)
    for m in range(9):
        assert torch.equal(y[m], native.linear_f32(x[m:m + 1], w)[0]), m
    with pytest.raises(RuntimeError, match="fp32"):
        native.linear_f32(x.bfloat16(), w)


@pytest.mark.parametrize("E,G,TG,K,norm", [(16, 1, 1, 4, True), (64, 8, 4, 6, True), (32, 4, 2, 8, False)])
def test_sigmoid_group_router_rows_are_their_own_and_match_torchs_rule(E, G, TG, K, norm):
    """The sigmoid-group rule in one native call (deepseek_v3, glm4_moe: a verify's or a batched step's
    rows): row m of a 9-row call is the call with that row alone, bit for bit; and the rule is the
    torch one's (the same experts where no two choices sit within rounding, the weights to bf16)."""
    from engine.arch.router import SigmoidGroupRouter
    H = 96
    w = rand_bf16(E, H, seed=E, scale=0.2)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(G)) * 0.05
    x = rand_bf16(9, H, seed=K, scale=1.0)
    router = SigmoidGroupRouter(E, K, G, TG, norm, 2.5)
    weights = {"l.mlp.gate.weight": w, "l.mlp.gate.e_score_correction_bias": bias}
    ids, got = native.route_sigmoid_group(x, w, bias, K, G, TG, norm, 2.5)
    assert ids.shape == (9, K) and ids.dtype == torch.int64 and got.dtype == torch.bfloat16
    for m in range(9):
        one = native.route_sigmoid_group(x[m:m + 1], w, bias, K, G, TG, norm, 2.5)
        assert torch.equal(one[0][0], ids[m]) and torch.equal(one[1][0], got[m]), m
    assert all(torch.equal(a, b) for a, b in zip(router.route(weights, "l", x), (ids, got)))  # the router takes it
    # torch's rule, as SigmoidGroupRouter computes it for a prompt's group (more rows than the kernel takes)
    scores = F.linear(x.float(), w.float()).sigmoid()
    choice = scores + bias
    group = choice.view(9, G, E // G).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros(9, G).scatter_(1, group.topk(TG, dim=-1)[1], 1.0).repeat_interleave(E // G, dim=1)
    ref_ids = choice.masked_fill(keep == 0, float("-inf")).topk(K, dim=-1)[1]
    ref_w = scores.gather(1, ref_ids)
    ref_w = (ref_w / (ref_w.sum(-1, keepdim=True) + 1e-20) if norm else ref_w) * 2.5
    assert torch.equal(ids.sort(dim=1)[0], ref_ids.sort(dim=1)[0])
    order, ref_order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    assert torch.allclose(got.gather(1, order).float(), ref_w.gather(1, ref_order), rtol=2 ** -7, atol=1e-6)


def test_route_topk_and_combine_take_rows_each_its_own():
    """Softmax routing of T rows and the weighted sum of B rows' K outputs: each row the one-row call's bits."""
    x, w = rand_bf16(7, 64, seed=1), rand_bf16(24, 64, seed=2)
    ids, weights = native.route_topk(x, w, 4, True)
    ys = rand_bf16(7 * 4, 80, seed=3)
    y = native.combine(ys, weights)
    assert ids.shape == weights.shape == (7, 4) and y.shape == (7, 80)
    for t in range(7):
        one_ids, one_w = native.route_topk(x[t:t + 1], w, 4, True)
        assert torch.equal(one_ids[0], ids[t]) and torch.equal(one_w[0], weights[t]), t
        assert torch.equal(native.combine(ys[4 * t:4 * t + 4], weights[t])[0], y[t]), t


# --- int8 / int4 -------------------------------------------------------------------------------------

def _quant_weight(w: torch.Tensor, quant: str, group: int, dtype: torch.dtype) -> QuantWeight:
    """int4: in strips (the native kernel's layout); int8: the codes and scales as stored (not probing
    torch's packed int8 kernel, which the native ops do not use)."""
    return QuantWeight.prepare(*quantize(w, quant, group), quant, group, dtype, packed_kernel=quant == "int4")


@needs_native_int()
@pytest.mark.parametrize("quant,group,N,K", [("int8", 0, 70, 100), ("int8", 0, 33, 2100), ("int4", 32, 70, 96),
                                             ("int4", 64, 18, 128), ("int4", 128, 48, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int_linear_rows_are_the_one_row_bits(quant, group, N, K, dtype):
    """int8 with a ragged K (masked tail; past one 2048-input flush), int4 with rows past the last
    full strip (N % 16): row m of an M-row call is the 1-row call's bits."""
    g = torch.Generator().manual_seed(N + K)
    qw = _quant_weight(torch.randn(N, K, generator=g), quant, group, dtype)
    op = ((lambda x: native.int4_linear(x, qw.qweight, group)) if quant == "int4"
          else (lambda x: native.int8_linear(x, qw.qweight, qw.qscale)))
    for M in (1, 3, 5, 7):
        x = torch.randn(M, K, generator=g).to(dtype)
        y = op(x)
        for m in range(M):
            assert torch.equal(y[m], op(x[m:m + 1])[0]), (M, m)


def _quant_experts(quant: str, group: int, E: int, H: int, I: int, dtype, seed: int) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(_quant_weight(torch.randn(*shape, generator=g) * 0.2, quant, group, dtype)
                  for shape in ((I, H), (I, H), (H, I))) for _ in range(E)]


def _flat(expert: tuple) -> list:
    return [t for w in expert for t in (w.qweight, w.qscale)]


# int8 with H and I off the 64-blocks; int4 of each group (I a multiple of the group, so of 16: whole strips).
@needs_native_int()
@pytest.mark.parametrize("quant,group,H,I,E,M,k", [
    ("int8", 0, 100, 37, 7, 5, 3), ("int8", 0, 130, 72, 4, 7, 4), ("int8", 0, 64, 48, 3, 1, 2),
    ("int4", 32, 96, 160, 6, 6, 3), ("int4", 64, 128, 192, 5, 3, 5), ("int4", 128, 256, 128, 9, 7, 2),
    ("int4", 32, 64, 32, 2, 7, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_experts_rows_give_each_slot_the_one_row_bits(quant, group, H, I, E, M, k, dtype):
    experts = _quant_experts(quant, group, E, H, I, dtype, seed=H + I + E)
    weights = [t for ex in experts for t in _flat(ex)]
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(M)).to(dtype)
    slot_row, slot_expert = _slots(M, E, k, seed=M * E)
    y = native.quant_experts_rows(x, weights, group, slot_row, slot_expert)
    assert y.shape == (len(slot_row), H) and y.dtype == dtype
    for s, (r, e) in enumerate(zip(slot_row.tolist(), slot_expert.tolist())):
        alone = native.quant_experts(x[r:r + 1], _flat(experts[e]), group)
        assert torch.equal(y[s], alone[0]), (s, r, e)


@needs_native_int()
@pytest.mark.parametrize("quant,group", [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 0)])
def test_quant_experts_rows_serve_one_expert_up_to_many_rows(quant, group):
    """One expert on n = 1..11 rows of a step (the kernels share each weight chunk's unpacking among
    up to four of its rows a pass, then take the rest): every slot the bits of its row alone."""
    H, I = 128, 256
    experts = _quant_experts(quant, group, 2, H, I, torch.bfloat16, seed=group + 11)
    weights = [t for ex in experts for t in _flat(ex)]
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(group)).bfloat16()
    alone = [native.quant_experts(x[r:r + 1], _flat(experts[1]), group)[0] for r in range(11)]
    for n in range(1, 12):
        rows = torch.arange(n, dtype=torch.int64)
        y = native.quant_experts_rows(x, weights, group, rows, torch.ones(n, dtype=torch.int64))
        for r in range(n):
            assert torch.equal(y[r], alone[r]), (n, r)


@needs_native_int()
def test_quant_experts_rows_refuse_unsorted_slots():
    experts = _quant_experts("int8", 0, 2, 64, 32, torch.bfloat16, seed=1)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="sorted by expert"):
        native.quant_experts_rows(x, [t for ex in experts for t in _flat(ex)], 0, torch.tensor([0, 1]),
                                  torch.tensor([1, 0]))


# --- attention -----------------------------------------------------------------------------------------

NONE = torch.empty(0, dtype=torch.bfloat16)


def _rope(D: int, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, D] cos and sin, row b for positions[b] (rotate-half layout)."""
    angle = torch.arange(D // 2).float()[None] * 0.37 * (torch.tensor(positions).float()[:, None] + 1)
    return torch.cat([angle.cos()] * 2, 1).bfloat16(), torch.cat([angle.sin()] * 2, 1).bfloat16()


def _cache(kind: str, Nkv: int, ctx: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled cache and its scales: bf16 rows, or int8 / fp8 codes with fp32 scales per row."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(Nkv, ctx, D, generator=g)
    if kind == "bf16":
        return values.bfloat16(), native.NO_SCALES
    scales = torch.rand(Nkv, ctx, generator=g) * 0.05 + 0.01
    if kind == "int8":
        return (values * 40).round().clamp(-127, 127).to(torch.int8), scales
    return (values * 100).clamp(-448, 448).to(torch.float8_e4m3fn), scales


def _clones(caches: list) -> list:
    """The caches copied, a cache shared by several rows still one tensor (one copy)."""
    copies: dict[int, torch.Tensor] = {}
    return [copies.setdefault(id(t), t.clone()) for t in caches]


# (rows: (cache index, position) per row; cache index -1 = a fresh cache of its own), per case: rows
# of their own caches at ragged positions, and a verify's consecutive positions in one cache beside
# another sequence.
ROWS = {"ragged": [(0, 0), (1, 9), (2, 3), (3, 70), (4, 5)], "verify": [(0, 4), (1, 20), (1, 21), (1, 22), (2, 0)],
        "one": [(0, 7)]}


def _attention_case(kind: str, rows: list, Nkv: int, D: int, ctx: int = 80):
    n_caches = max(c for c, _ in rows) + 1
    made = [(_cache(kind, Nkv, ctx, D, seed=2 * c), _cache(kind, Nkv, ctx, D, seed=2 * c + 1)) for c in range(n_caches)]
    k = [made[c][0][0] for c, _ in rows]
    v = [made[c][1][0] for c, _ in rows]
    ks = [made[c][0][1] for c, _ in rows]
    vs = [made[c][1][1] for c, _ in rows]
    return k, v, ks, vs, [p for _, p in rows]


def _solo_and_batched(call_one, call_rows, kind, rows, H, Nkv, D):
    """Every row alone (in row order, on copies of the caches) against one batched call: outputs
    and every cache and scale written equal bit for bit."""
    k, v, ks, vs, positions = _attention_case(kind, rows, Nkv, D)
    B = len(rows)
    x = rand_bf16(B, H, seed=B + H)
    cos, sin = _rope(D, positions)
    solo_caches = [_clones(t) for t in (k, v, ks, vs)]
    solo = torch.cat([call_one(x[b:b + 1], cos[b:b + 1], sin[b:b + 1], *(c[b] for c in solo_caches), positions[b])
                      for b in range(B)])
    y = call_rows(x, cos, sin, k, v, None if kind == "bf16" else ks, None if kind == "bf16" else vs, positions)
    assert y.shape == (B, H) and torch.equal(y, solo)
    for batched, alone in zip((k, v, ks, vs), solo_caches):
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                   for a, b in zip(batched, alone))


@pytest.mark.parametrize("kind", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("rows", ["ragged", "verify", "one"])
@pytest.mark.parametrize("H,Nq,Nkv,D,head_norm", [(100, 6, 3, 24, True), (64, 4, 4, 16, False)])
def test_attention_rows_give_each_row_the_one_row_bits(kind, rows, H, Nq, Nkv, D, head_norm):
    norm_w = rand_bf16(H, seed=2).abs() + 0.5
    qkv_w, o_w = rand_bf16((Nq + 2 * Nkv) * D, H, seed=3, scale=0.1), rand_bf16(H, Nq * D, seed=4, scale=0.1)
    q_norm, k_norm = (rand_bf16(D, seed=5).abs() + 0.5, rand_bf16(D, seed=6).abs() + 0.5) if head_norm else (NONE, NONE)

    def one(x, cos, sin, k, v, ks, vs, pos):
        return native.attention_decode(x, norm_w, 1e-6, qkv_w, q_norm, k_norm, cos, sin, k, v, pos, Nq, Nkv, o_w, ks, vs)

    def batched(x, cos, sin, k, v, ks, vs, positions):
        return native.attention_decode_rows(x, norm_w, 1e-6, qkv_w, q_norm, k_norm, cos, sin, k, v, positions, Nq, Nkv,
                                            o_w, ks, vs)

    _solo_and_batched(one, batched, kind, ROWS[rows], H, Nkv, D)


@needs_native_int()
@pytest.mark.parametrize("quant,group,H,Nq,Nkv,D", [("int8", 0, 100, 6, 3, 24), ("int4", 32, 64, 6, 2, 16),
                                                    ("int4", 64, 128, 8, 2, 32), ("int4", 128, 256, 4, 2, 64)])
@pytest.mark.parametrize("kind,rows", [("bf16", "ragged"), ("int8", "verify"), ("fp8", "ragged")])
def test_int_attention_rows_give_each_row_the_one_row_bits(quant, group, H, Nq, Nkv, D, kind, rows):
    g = torch.Generator().manual_seed(H + D)
    mats = [_quant_weight(torch.randn(*shape, generator=g) * 0.1, quant, group, torch.bfloat16)
            for shape in ((Nq * D, H), (Nkv * D, H), (Nkv * D, H), (H, Nq * D))]
    proj = [t for m in mats for t in (m.qweight, m.qscale)]
    norm_w = rand_bf16(H, seed=2).abs() + 0.5
    q_norm, k_norm = rand_bf16(D, seed=5).abs() + 0.5, rand_bf16(D, seed=6).abs() + 0.5

    def one(x, cos, sin, k, v, ks, vs, pos):
        return native.attention_decode_int(x, norm_w, 1e-6, proj, group, q_norm, k_norm, cos, sin, k, v, pos, Nq, Nkv,
                                           ks, vs)

    def batched(x, cos, sin, k, v, ks, vs, positions):
        return native.attention_decode_int_rows(x, norm_w, 1e-6, proj, group, q_norm, k_norm, cos, sin, k, v,
                                                positions, Nq, Nkv, ks, vs)

    _solo_and_batched(one, batched, kind, ROWS[rows], H, Nkv, D)


@pytest.mark.parametrize("positions,same_v,message", [
    ([5, 5], False, "increasing positions"), ([6, 5], False, "increasing positions"),
    ([5, 6], True, "K cache and a V cache")])
def test_attention_rows_refuse_rows_that_would_not_be_their_solo_bits(positions, same_v, message):
    """Rows of one cache out of order would read a later row's K/V; a tensor as K of one row and V of
    another would be written twice over."""
    H, Nq, Nkv, D = 64, 4, 2, 16
    k = torch.zeros(Nkv, 8, D, dtype=torch.bfloat16)
    v = k if same_v else torch.zeros_like(k)
    cos, sin = _rope(D, positions)
    with pytest.raises(RuntimeError, match=message):
        native.attention_decode_rows(rand_bf16(2, H, seed=1), rand_bf16(H, seed=2), 1e-6,
                                     rand_bf16((Nq + 2 * Nkv) * D, H, seed=3), NONE, NONE, cos, sin, [k, k], [v, v],
                                     positions, Nq, Nkv, rand_bf16(H, Nq * D, seed=4))
