"""Synthetic MoE models: a valid Hugging Face directory (qwen3_moe layout) of any geometry, from a seed.

Written shard by shard and tensor by tensor (memory bounded by the largest tensor), into a
temporary sibling directory that is renamed into place only when complete. Every tensor comes
from a torch.Generator seeded by sha256(seed, tensor name), so the same seed gives the same bytes.

`routing_skew` (X) shapes the weights so that the engine's ordinary routing is closer to a real
MoE model's than uniform random routing (see docs/SYNTH.md for the measured effect):
  * popularity: every embedding carries a constant "massive activation" on channel 0 and each
    layer's router reads that channel with a per-expert weight spread like normal quantiles
    (scaled by X), so some experts win far more often than others, differently per layer;
  * locality: q/k projections also read channel 0 (share min(X, 1)), which makes q and k nearly
    constant per head; through RoPE that turns attention into a smooth window over the last few
    tokens, and o_proj (gain grows with X) writes that windowed context back into the residual,
    so consecutive tokens' router inputs share most of their context and pick overlapping experts.
X = 0 gives the plain random initialisation (near-uniform routing).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

# The tokenizer (engine/bpe_tokenizer.py): 256 byte tokens, <|endoftext|> at 256, then BPE merges.
from engine.bpe_tokenizer import EOS_TOKEN, EOS_TOKEN_ID, MIN_VOCAB
from engine.errors import ConfigError

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
SYNTH_VERSION = 1  # bump when the weight recipe changes (the same seed then gives other bytes)

# Keys every materializable (qwen3_moe) geometry must provide, with their types.
_REQUIRED_INT = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size",
)
_DEFAULTS = {
    "model_type": "qwen3_moe",
    "intermediate_size": None,  # filled from moe_intermediate_size; unused when every layer is MoE
    "max_position_embeddings": 4096,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "norm_topk_prob": True,
    "dtype": "bfloat16",
    "routing_skew": 1.0,
    "max_shard_size": 512 * 1024 * 1024,
    "initializer_range": 0.02,
}
_DTYPES = ("bfloat16", "float32", "float16")

# Recipe constants, calibrated with benchmarks/routing_skew.py (docs/SYNTH.md has the table).
EMBED_STD = 1.0        # token content must dominate the residual at X=0 (near-uniform routing)
POPULARITY = 0.9       # router bias spread per unit of X, in units of the token-driven logit std
CONTEXT_GAIN = 1.3     # layer-0 windowed-context scale per unit of X, relative to the embedding
ATTN_PEAK = 14.0       # score of a token attending to itself under the positional kernel
ROPE_BAND = (0.01, 0.3)  # RoPE frequencies (rad/token) the positional kernel uses: a ~4-6 token window


# --- presets and geometry --------------------------------------------------------------------

def list_presets() -> list[str]:
    """Names of the bundled presets: materializable ones and geometry-only specs of real models."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_preset(name: str) -> dict:
    """The geometry dict of a bundled preset (config.json-like keys plus name/materializable/source)."""
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(list_presets())}")
    return _read_geometry_json(path)


def load_geometry_file(path: str | os.PathLike) -> dict:
    """A user geometry JSON with the same keys as a preset."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"geometry file {str(path)!r} not found")
    return _read_geometry_json(path)


def _read_geometry_json(path: Path) -> dict:
    try:
        geom = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path.name}: not valid JSON ({exc})") from None
    if not isinstance(geom, dict):
        raise ConfigError(f"{path.name}: expected a JSON object of geometry keys")
    geom.setdefault("name", path.stem)
    return geom


def validate_geometry(geometry: dict) -> dict:
    """Checks a geometry can be materialized; returns a copy with defaults filled in."""
    if not isinstance(geometry, dict):
        raise ConfigError("geometry must be a JSON object")
    name = geometry.get("name", "custom")
    if geometry.get("materializable") is False:
        src = geometry.get("source", "its published config")
        raise ConfigError(
            f"preset {name!r} is a geometry-only spec of a real model ({src}) for planning; "
            "it is never materialized — use 'tiny', 'demo' or --geometry FILE"
        )
    g = {**_DEFAULTS, **geometry}
    if g["model_type"] != "qwen3_moe":
        raise ConfigError(f"{name}: synth writes only model_type 'qwen3_moe', not {g['model_type']!r}")
    for key in _REQUIRED_INT:
        v = g.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{name}: '{key}' must be a positive integer, got {v!r}")
    if g["intermediate_size"] is None:
        g["intermediate_size"] = g["moe_intermediate_size"]
    if g["num_attention_heads"] % g["num_key_value_heads"]:
        raise ConfigError(f"{name}: num_attention_heads must be a multiple of num_key_value_heads")
    if g["head_dim"] % 2:
        raise ConfigError(f"{name}: head_dim must be even (RoPE rotates pairs)")
    if g["num_experts_per_tok"] > g["num_experts"]:
        raise ConfigError(f"{name}: num_experts_per_tok exceeds num_experts")
    if g["vocab_size"] < MIN_VOCAB:
        raise ConfigError(f"{name}: vocab_size must be at least {MIN_VOCAB} (256 byte tokens + {EOS_TOKEN})")
    if g["dtype"] not in _DTYPES:
        raise ConfigError(f"{name}: dtype must be one of {', '.join(_DTYPES)}, got {g['dtype']!r}")
    for key in ("routing_skew", "rope_theta", "rms_norm_eps", "initializer_range"):
        v = g[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{name}: '{key}' must be a non-negative number, got {v!r}")
    ms = g["max_shard_size"]
    if isinstance(ms, bool) or not isinstance(ms, int) or ms <= 0:
        raise ConfigError(f"{name}: 'max_shard_size' must be a positive integer (bytes), got {ms!r}")
    return g


# --- planning ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    kind: str            # what the recipe makes of it: embed, lm_head, norm, q, k, v, o, q_norm, ...
    layer: int = -1
    expert: int = -1


def tensor_plan(g: dict) -> list[list[PlannedTensor]]:
    """Tensors in file order, grouped into units that must stay together in one shard.

    An expert's gate, up and down projections form one unit so they are adjacent on disk and
    the streaming engine can read an expert with a single request.
    """
    H, L = g["hidden_size"], g["num_hidden_layers"]
    nh, nkv, hd = g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]
    E, I, V = g["num_experts"], g["moe_intermediate_size"], g["vocab_size"]
    units: list[list[PlannedTensor]] = [[PlannedTensor("model.embed_tokens.weight", (V, H), "embed")]]
    for i in range(L):
        p = f"model.layers.{i}."
        for name, shape, kind in (
            ("input_layernorm.weight", (H,), "norm"),
            ("self_attn.q_proj.weight", (nh * hd, H), "q"),
            ("self_attn.k_proj.weight", (nkv * hd, H), "k"),
            ("self_attn.v_proj.weight", (nkv * hd, H), "v"),
            ("self_attn.o_proj.weight", (H, nh * hd), "o"),
            ("self_attn.q_norm.weight", (hd,), "qk_norm"),
            ("self_attn.k_norm.weight", (hd,), "qk_norm"),
            ("post_attention_layernorm.weight", (H,), "norm"),
            ("mlp.gate.weight", (E, H), "router"),
        ):
            units.append([PlannedTensor(p + name, shape, kind, i)])
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            units.append([
                PlannedTensor(q + "gate_proj.weight", (I, H), "expert_in", i, e),
                PlannedTensor(q + "up_proj.weight", (I, H), "expert_in", i, e),
                PlannedTensor(q + "down_proj.weight", (H, I), "expert_out", i, e),
            ])
    units.append([PlannedTensor("model.norm.weight", (H,), "norm")])
    units.append([PlannedTensor("lm_head.weight", (V, H), "lm_head")])
    return units


def plan_shards(units: list[list[PlannedTensor]], dtype: str, max_shard_size: int) -> list[list[PlannedTensor]]:
    """Greedy packing of units into shards of at most max_shard_size data bytes (a bigger unit gets its own)."""
    from engine.safetensors_writer import DTYPES
    elem = DTYPES[dtype][1]
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for unit in units:
        ub = sum(math.prod(t.shape) * elem for t in unit)
        if shards[-1] and size + ub > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += ub
    return shards


def model_bytes(geometry: dict) -> int:
    """Bytes of tensor data a synthesized model of this geometry holds (headers excluded)."""
    from engine.safetensors_writer import DTYPES
    g = validate_geometry(geometry)
    elem = DTYPES[g["dtype"]][1]
    return sum(math.prod(t.shape) * elem for unit in tensor_plan(g) for t in unit)


# --- the weight recipe ------------------------------------------------------------------------

def _seed_for(seed: int, key: str) -> int:
    # Not Python's hash(): that is salted per process, and the bytes must not be.
    digest = hashlib.sha256(f"colibri-synth/v{SYNTH_VERSION}|{seed}|{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class _Recipe:
    """Values of each tensor as a float32 torch tensor, a pure function of (geometry, seed, skew, name)."""

    def __init__(self, g: dict, seed: int, skew: float):
        import torch
        self.torch = torch
        self.g, self.seed, self.x = g, seed, float(skew)
        H, L, hd = g["hidden_size"], g["num_hidden_layers"], g["head_dim"]
        self.std = g["initializer_range"]
        self.out_std = self.std / math.sqrt(2 * L)  # residual branches: keep the stream's scale over depth
        self.lam = min(1.0, self.x)                  # share of q/k given to the positional kernel
        self.structured = self.x > 0
        # q_norm/k_norm gain so that the positional kernel's self-score is ATTN_PEAK at lam = 1.
        self.qk_gain = math.sqrt(1.0 + self.lam * (ATTN_PEAK / math.sqrt(hd) - 1.0))
        self.band = self._rope_band_vector(hd, g["rope_theta"])
        self.massive = EMBED_STD * math.sqrt(H)      # channel-0 value shared by every token
        self._popularity: dict[int, "torch.Tensor"] = {}
        self._scratch = None

    def _normal(self, name: str, shape, std: float):
        """N(0, std) values in a reused scratch buffer (valid until the next call).

        One buffer for all tensors spares a fresh multi-MB allocation (and its page faults) per tensor.
        """
        torch = self.torch
        n = math.prod(shape)
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.float32)
        t = self._scratch[:n].view(shape)
        gen = torch.Generator().manual_seed(_seed_for(self.seed, name))
        torch.randn(shape, generator=gen, out=t)
        return t.mul_(std)

    def _rope_band_vector(self, hd: int, theta: float):
        """Unit vector over head_dim with its energy on the RoPE pairs whose frequency is in ROPE_BAND.

        With q = k = this vector at every position, q·k after RoPE is sum_i w_i cos(theta_i * distance):
        largest at distance 0 and falling off over a few tokens, i.e. a recency window.
        """
        torch = self.torch
        half = hd // 2
        freqs = [theta ** (-2.0 * i / hd) for i in range(half)]
        pairs = [i for i, f in enumerate(freqs) if ROPE_BAND[0] <= f <= ROPE_BAND[1]]
        if len(pairs) < 2:  # small head_dim: fall back to the pairs nearest the band's middle
            mid = math.sqrt(ROPE_BAND[0] * ROPE_BAND[1])
            pairs = sorted(range(half), key=lambda i: abs(math.log(freqs[i] / mid)))[: max(2, half // 4)]
        u = torch.zeros(hd)
        for i in pairs:
            u[i] = u[i + half] = 1.0
        return u / u.norm()

    def _o_std(self, layer: int) -> float:
        """o_proj std. Layer 0 carries the context: its windowed average of the embeddings is written
        into the residual with CONTEXT_GAIN * X times the per-element scale of the token's own
        embedding, so every later router sees the same mix of token and recent context.
        """
        if not self.structured or layer != 0:
            return self.out_std
        g = self.g
        # v elements ~ std * |h_rest| = std * sqrt(H/2); a ~4-token window averages them down by 2;
        # o_proj sums nh*hd of them.
        v_avg = self.std * math.sqrt(g["hidden_size"] / 2) / 2
        ctx = CONTEXT_GAIN * self.x * EMBED_STD / (v_avg * math.sqrt(g["num_attention_heads"] * g["head_dim"]))
        return math.sqrt(self.out_std ** 2 + ctx ** 2)

    def popularity(self, layer: int):
        """Per-expert router weight on channel 0: normal quantiles, shuffled differently per layer."""
        if layer not in self._popularity:
            torch = self.torch
            E = self.g["num_experts"]
            gen = torch.Generator().manual_seed(_seed_for(self.seed, f"popularity.{layer}"))
            perm = torch.randperm(E, generator=gen)
            quantiles = torch.special.ndtri((torch.arange(E, dtype=torch.float64) + 0.5) / E).float()
            self._popularity[layer] = quantiles[perm]
        return self._popularity[layer]

    def values(self, t: PlannedTensor):
        torch, g, x = self.torch, self.g, self.x
        kind, shape = t.kind, t.shape
        if kind == "norm":
            return torch.ones(shape)
        if kind == "qk_norm":
            return torch.full(shape, self.qk_gain)
        if kind == "embed":
            w = self._normal(t.name, shape, EMBED_STD)
            if self.structured:
                w[:, 0] = self.massive
            return w
        if kind == "lm_head":
            return self._normal(t.name, shape, self.std)
        if kind in ("q", "k"):
            w = self._normal(t.name, shape, self.std * math.sqrt(1.0 - self.lam ** 2))
            if self.structured:
                # Structured share of each head's q/k energy is lam^2 (token content ~ H/2 of |h|^2,
                # the massive channel the other half), so the scale is std * sqrt(head_dim).
                heads = shape[0] // g["head_dim"]
                w[:, 0] = self.lam * self.std * math.sqrt(g["head_dim"]) * self.band.repeat(heads)
            return w
        if kind == "v":
            w = self._normal(t.name, shape, self.std)
            if self.structured:
                w[:, 0] = 0.0  # values carry token content only, not the shared constant
            return w
        if kind == "o":
            w = self._normal(t.name, shape, self._o_std(t.layer))
            if self.structured:
                w[0, :] = 0.0  # keep the massive channel exactly constant through depth
            return w
        if kind == "router":
            w = self._normal(t.name, shape, self.std)
            if self.structured:
                w[:, 0] = x * POPULARITY * self.std * self.popularity(t.layer)
            return w
        if kind == "expert_in":
            return self._normal(t.name, shape, self.std)
        if kind == "expert_out":
            w = self._normal(t.name, shape, self.out_std)
            if self.structured:
                w[0, :] = 0.0
            return w
        raise AssertionError(f"no recipe for tensor kind {kind!r}")


# --- side files -------------------------------------------------------------------------------

def hf_config(g: dict, seed: int, skew: float) -> dict:
    """config.json as transformers' Qwen3MoeConfig writes it, readable by transformers 4.x and 5.x."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": g["head_dim"],
        "hidden_act": "silu",
        "hidden_size": g["hidden_size"],
        "initializer_range": g["initializer_range"],
        "intermediate_size": g["intermediate_size"],
        "max_position_embeddings": g["max_position_embeddings"],
        "moe_intermediate_size": g["moe_intermediate_size"],
        "norm_topk_prob": bool(g["norm_topk_prob"]),
        "num_attention_heads": g["num_attention_heads"],
        "num_experts": g["num_experts"],          # transformers 4.x spelling
        "num_local_experts": g["num_experts"],    # transformers 5.x spelling
        "num_experts_per_tok": g["num_experts_per_tok"],
        "num_hidden_layers": g["num_hidden_layers"],
        "num_key_value_heads": g["num_key_value_heads"],
        "output_router_logits": False,
        "rms_norm_eps": g["rms_norm_eps"],
        "rope_theta": float(g["rope_theta"]),
        "rope_parameters": {"rope_theta": float(g["rope_theta"]), "rope_type": "default"},
        "rope_scaling": None,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": g["dtype"],
        "dtype": g["dtype"],
        "vocab_size": g["vocab_size"],
        "colibri_synth": {
            "version": SYNTH_VERSION,
            "preset": g.get("name", "custom"),
            "seed": seed,
            "routing_skew": skew,
        },
    }


# --- synthesis --------------------------------------------------------------------------------

def synthesize(
    geometry: dict,
    out_dir: str | os.PathLike,
    seed: int = 0,
    routing_skew: float | None = None,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Write a qwen3_moe HF directory for `geometry` to out_dir, atomically; returns its path.

    routing_skew None takes the geometry's own default (the presets' calibrated value).
    Refuses an existing non-empty out_dir unless force (then it is replaced only once the new
    model is complete).
    """
    from tqdm import tqdm
    from engine.safetensors_writer import ShardWriter, TensorSpec, write_json_atomic

    g = validate_geometry(geometry)
    skew = g["routing_skew"] if routing_skew is None else routing_skew
    if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not math.isfinite(skew) or skew < 0:
        raise ConfigError(f"routing skew must be a non-negative number, got {skew!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    skew = float(skew)

    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"output directory {str(out)!r} is not empty (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)

    units = tensor_plan(g)
    shards = plan_shards(units, g["dtype"], g["max_shard_size"])
    total = sum(TensorSpec(t.name, t.shape, g["dtype"]).nbytes for s in shards for t in s)
    free = shutil.disk_usage(out.parent).free
    if free < total + (16 << 20):
        raise ConfigError(
            f"not enough free space in {str(out.parent)!r}: need {total / 2**30:.2f} GiB, have {free / 2**30:.2f} GiB"
        )

    tmp = out.parent / f"{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    import torch
    threads = torch.get_num_threads()
    # Element-wise ops on a few MB gain nothing from OpenMP and lose badly to its spin-waits when
    # the cores are busy (60x slower measured on a loaded 2-core box); randn is serial anyway.
    torch.set_num_threads(1)
    try:
        recipe = _Recipe(g, seed, skew)
        n = len(shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map: dict[str, str] = {}
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                   desc=f"synth {g.get('name', 'custom')}", disable=not progress, leave=True)
        with bar:
            for fname, shard in zip(names, shards):
                specs = [TensorSpec(t.name, t.shape, g["dtype"]) for t in shard]
                with ShardWriter(tmp / fname, specs) as w:
                    for t in shard:
                        bar.update(w.write(t.name, recipe.values(t)))
                        weight_map[t.name] = fname
        if n > 1:
            write_json_atomic(tmp / "model.safetensors.index.json", {
                "metadata": {"total_size": total,
                             "total_parameters": sum(math.prod(t.shape) for s in shards for t in s)},
                "weight_map": dict(sorted(weight_map.items())),
            })
        write_json_atomic(tmp / "config.json", hf_config(g, seed, skew))
        write_json_atomic(tmp / "generation_config.json", {
            "bos_token_id": None, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": None, "do_sample": False,
        })
        _write_tokenizer(tmp, g)
        _fsync_dir(tmp)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return out


def _write_tokenizer(dir_: Path, g: dict) -> None:
    from engine.bpe_tokenizer import build_tokenizer, tokenizer_config
    from engine.safetensors_writer import write_json_atomic
    tok = build_tokenizer(g["vocab_size"])
    tmp = dir_ / f".tokenizer.json.tmp-{os.getpid()}"
    tok.save(str(tmp), pretty=False)
    os.replace(tmp, dir_ / "tokenizer.json")
    write_json_atomic(dir_ / "tokenizer_config.json", tokenizer_config(g["max_position_embeddings"]))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory to out; an existing out (only with force) is removed afterwards."""
    old = None
    if out.exists():
        if not any(out.iterdir()):
            out.rmdir()
        else:
            old = out.parent / f"{out.name}.old-{os.getpid()}"
            os.replace(out, old)
    os.replace(tmp, out)
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- planning figures for any geometry (including the geometry-only specs) ----------------------

def param_counts(geometry: dict) -> dict:
    """Parameter counts by role, for qwen3_moe, mixtral, olmoe, deepseek_v3 and glm_moe_dsa geometries.

    Returns total, active (per token), routed_expert (one expert), routed_total, dense (everything
    that is not a routed expert: the part a streaming engine keeps resident), num_moe_layers,
    num_experts, top_k. Multi-token-prediction layers are not counted (inference skips them).
    """
    g = geometry
    mt = g.get("model_type")
    H, L, V = g["hidden_size"], g["num_hidden_layers"], g["vocab_size"]
    E = g.get("num_experts") or g.get("n_routed_experts") or g.get("num_local_experts")
    k = g["num_experts_per_tok"]
    if not E:
        raise ConfigError(f"{g.get('name', mt)}: geometry has no expert count")
    nh = g["num_attention_heads"]
    if mt in ("deepseek_v3", "glm_moe_dsa"):
        qk_head = g["qk_nope_head_dim"] + g["qk_rope_head_dim"]
        qr, kvr = g.get("q_lora_rank"), g["kv_lora_rank"]
        q = (H * qr + qr + qr * nh * qk_head) if qr else H * nh * qk_head
        kv = H * (kvr + g["qk_rope_head_dim"]) + kvr + kvr * nh * (g["qk_nope_head_dim"] + g["v_head_dim"])
        attn = q + kv + nh * g["v_head_dim"] * H
        if mt == "glm_moe_dsa":  # DSA lightning indexer
            ih, idim = g["index_n_heads"], g["index_head_dim"]
            attn += (qr or H) * ih * idim + H * idim + 2 * idim + H * ih
        moe_i = g["moe_intermediate_size"]
        dense_layers = g.get("first_k_dense_replace", 0)
        shared = g.get("n_shared_experts", 0) or 0
        router = E * H + E  # + e_score_correction_bias
    else:
        hd = g.get("head_dim") or H // nh
        nkv = g.get("num_key_value_heads", nh)
        attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H
        if mt == "qwen3_moe":
            attn += 2 * hd
        elif mt == "olmoe":
            attn += H + nkv * hd
        moe_i = g["moe_intermediate_size"] if mt == "qwen3_moe" else g["intermediate_size"]
        dense_layers, shared, router = 0, 0, E * H
    expert = 3 * H * moe_i
    moe_layers = L - dense_layers
    norms = 2 * H
    dense_mlp = 3 * H * g.get("intermediate_size", 0)
    embed = V * H * (1 if g.get("tie_word_embeddings") else 2)
    resident = (embed + H + L * (attn + norms) + dense_layers * dense_mlp
                + moe_layers * (router + shared * expert))
    routed_total = moe_layers * E * expert
    return {
        "total": resident + routed_total,
        "active": resident + moe_layers * k * expert,
        "routed_expert": expert,
        "routed_total": routed_total,
        "dense": resident,
        "num_moe_layers": moe_layers,
        "num_experts": E,
        "top_k": k,
    }


def describe_presets() -> list[dict]:
    """One row per preset: name, materializable, description, source, total/active params."""
    rows = []
    for name in list_presets():
        g = load_preset(name)
        counts = param_counts({**_DEFAULTS, **g}) if g.get("materializable", True) else param_counts(g)
        rows.append({
            "name": name,
            "materializable": g.get("materializable", True) is not False,
            "description": g.get("description", ""),
            "source": g.get("source"),
            "total_params": counts["total"],
            "active_params": counts["active"],
        })
    return rows


def summarize(model_dir: str | os.PathLike) -> dict:
    """What a synthesized directory holds: path, bytes of shards, shard and tensor counts, seed, skew."""
    d = Path(model_dir)
    shards = sorted(d.glob("*.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    meta = cfg.get("colibri_synth", {})
    index = d / "model.safetensors.index.json"
    tensors = len(json.loads(index.read_text())["weight_map"]) if index.exists() else None
    if tensors is None:
        from engine.safetensors_writer import read_header
        tensors = len(read_header(shards[0])) if shards else 0
    return {
        "path": str(d),
        "bytes": sum(p.stat().st_size for p in shards),
        "shards": len(shards),
        "tensors": tensors,
        "seed": meta.get("seed"),
        "routing_skew": meta.get("routing_skew"),
        "preset": meta.get("preset"),
    }
