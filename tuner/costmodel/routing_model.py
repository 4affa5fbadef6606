"""Routing models and the expected RAM hit rate of a cache, by simulation with the engine's caches.

A routing model says which experts each token picks in each MoE layer:
  * popularity: per layer, how often each expert wins (flat for uniform routing, a recorded
    histogram's counts, or the spread synth's --routing-skew produces);
  * locality: the share `reuse` of the previous token's experts a token keeps beyond what
    popularity explains (real models keep ~40% of them; uniform routing 1/E·k).
Tokens are drawn as: keep each of the previous token's experts with probability `locality`,
fill the rest by Gumbel top-k over log-popularity (sampling without replacement, the shape of
a router's top-k over noisy logits).

The hit rate comes from feeding those tokens to the engine's own cache classes
(engine/movement/cache/: lru, lfu, pinned with its preload), charged one unit per expert, in the order
the engine asks: a prompt's union of experts per layer, then one token at a time; router
lookahead's wrong guesses are inserted too, because the engine offers them to the cache. So a
policy change in the engine changes the predictions without edits here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from engine.api import ConfigError, PINNED_FRACTION, hottest_keys, make_cache, routing_histogram_load
from tuner.costmodel.model_geometry import ModelGeometry

# Measured with benchmarks/tuning/routing_skew.py on the demo geometry (docs/SYNTH.md): per skew X,
# the share of the previous token's experts a token reuses, and the same against the token 32
# back (what popularity alone gives). Interpolated linearly in X between these points.
SYNTH_SKEW_TABLE = (  # X, reuse, reuse@32
    (0.0, 0.126, 0.127),
    (0.5, 0.196, 0.180),
    (1.0, 0.403, 0.219),
    (2.0, 0.531, 0.252),
)


@dataclass
class RoutingModel:
    kind: str  # "uniform", "skew", "histogram"
    popularity: np.ndarray  # [moe_layers, experts], rows sum to 1
    locality: float  # probability a previous-token expert is kept regardless of popularity
    description: str = ""
    # A recorded histogram's routings per layer: the pinned policy's ranking is that sample's,
    # so the simulation ranks a sample of the same size (None: rank by the popularity itself).
    sample_routings: int | None = None

    @property
    def layers(self) -> int:
        return self.popularity.shape[0]

    @property
    def experts(self) -> int:
        return self.popularity.shape[1]

    def hottest(self) -> list[tuple[int, int]]:
        """(layer index, expert) keys hottest first, as a recorded histogram ranks them."""
        counts = {(l, e): float(self.popularity[l, e]) for l in range(self.layers) for e in range(self.experts)}
        return hottest_keys(counts)


def uniform(layers: int, experts: int) -> RoutingModel:
    return RoutingModel("uniform", np.full((layers, experts), 1.0 / experts), 0.0, "uniform random routing")


def from_histogram(hist: dict, layers: int, experts: int, locality: float = 0.0) -> RoutingModel:
    """A recorded histogram {(layer, expert): count} (engine --record-routing); layers are the
    MoE layers in order. Unseen experts get half a count so they can still be drawn."""
    moe_layer_ids = sorted({l for l, _ in hist})
    pop = np.full((layers, experts), 0.5)
    for (layer, expert), n in hist.items():
        row = moe_layer_ids.index(layer)
        if row < layers and expert < experts:
            pop[row, expert] += n
    return RoutingModel("histogram", pop / pop.sum(axis=1, keepdims=True), locality,
                        f"recorded histogram ({sum(hist.values())} routings), locality {locality:.2f}",
                        sample_routings=max(1, sum(hist.values()) // max(len(moe_layer_ids), 1)))


def synth_skew(layers: int, experts: int, top_k: int, skew: float, seed: int = 0) -> RoutingModel:
    """The routing synth's --routing-skew X produces, matched to its measured reuse figures."""
    reuse, reuse32 = _interp_skew(skew)
    locality = max(0.0, (reuse - reuse32) / (1.0 - reuse32))
    scale = _popularity_scale(experts, top_k, reuse32)
    rng = np.random.default_rng(seed)
    z = _normal_quantiles(experts)
    rows = [np.exp(scale * rng.permutation(z)) for _ in range(layers)]
    pop = np.array(rows)
    return RoutingModel("skew", pop / pop.sum(axis=1, keepdims=True), locality,
                        f"synth routing skew {skew:g} (reuse {reuse:.0%}, locality {locality:.2f})")


def _interp_skew(x: float) -> tuple[float, float]:
    pts = SYNTH_SKEW_TABLE
    x = min(max(x, pts[0][0]), pts[-1][0])
    for (x0, r0, p0), (x1, r1, p1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            t = (x - x0) / (x1 - x0)
            return r0 + t * (r1 - r0), p0 + t * (p1 - p0)
    return pts[-1][1], pts[-1][2]


def _normal_quantiles(n: int) -> np.ndarray:
    from statistics import NormalDist
    nd = NormalDist()
    return np.array([nd.inv_cdf((i + 0.5) / n) for i in range(n)])


@lru_cache(maxsize=64)
def _popularity_scale(experts: int, top_k: int, target_overlap: float) -> float:
    """The log-popularity spread whose independent draws overlap by `target_overlap` (share of
    k), by bisection on a seeded Monte Carlo estimate."""
    floor = top_k / experts
    if target_overlap <= floor:
        return 0.0
    z = _normal_quantiles(experts)
    rng = np.random.default_rng(1)
    gumbel = rng.gumbel(size=(4000, experts))

    def overlap(scale: float) -> float:
        picks = np.argpartition(-(scale * z + gumbel), top_k - 1, axis=1)[:, :top_k]
        incl = np.bincount(picks.ravel(), minlength=experts) / len(picks)
        return float((incl ** 2).sum() / top_k)

    lo, hi = 0.0, 8.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if overlap(mid) < target_overlap else (lo, mid)
    return (lo + hi) / 2


# --- simulation -----------------------------------------------------------------------------

@dataclass
class HitRates:
    decode: float  # share of decode-time lookups served by the RAM cache, over all repeats
    prefill_misses_per_layer: float  # distinct experts a prompt reads per layer (not cached)
    decode_misses_per_token: float  # experts read per token, over all MoE layers
    wasted_prefetch_per_token: float  # lookahead reads of experts the token did not use
    decode_last: float | None = None  # the last repeat's decode hit rate (what `colibri bench` reports)


def simulate(routing: RoutingModel, top_k: int, cache_slots: int, policy: str, *, prompt_tokens: int = 8,
             tokens: int = 8, repeats: int = 1, cold: bool = True, warmup_tokens: int = 0,
             lookahead_recall: float | None = None, seed: int = 0, replay: bool = False,
             prelude_tokens: int = 0, pinned_from: int | None = None) -> HitRates:
    """Run the engine's cache policy over tokens drawn from `routing`.

    cold: the cache is emptied before every repeat, as `colibri bench --cold` does
    (ExpertCache.clear(): entries go, lfu's request counts stay); warm: one cache across
    repeats, after `warmup_tokens` unmeasured tokens (steady state).
    replay: every repeat replays one prompt and its continuation — the bench's trial: the same
    prompt each repeat, greedy sampling, so the same routing — instead of drawing fresh tokens.
    prelude_tokens: the bench's warm-up, a generation of this many tokens from the same prompt
    before the repeats (the prompt pass, then prelude_tokens - 1 decode steps), unmeasured.
    pinned_from: rank the pinned policy's keys by a histogram of this many routings per layer
    drawn from `routing` (the engine pins the hottest experts of the calibration run's recorded
    prompt, a sample, not the routing's true popularity); None ranks by the popularity itself.
    lookahead_recall: None without prefetch; else the share of a layer's experts the lookahead
    guesses right — the wrong guesses are read and offered to the cache, as the engine does.
    Every lookup goes through get(): the engine counts one served by lookahead toward lfu's
    popularity too (note_request), and lookahead never reads an expert the cache holds.
    """
    # Separate generators: the token stream is the same whatever the policy, the cache size or
    # the lookahead (comparisons between configs are not blurred by sampling noise).
    tokens_rng, rng = np.random.default_rng(seed), np.random.default_rng([seed, 1])
    L, E = routing.layers, routing.experts
    logp = np.log(routing.popularity)
    hottest = (_pinned_keys(routing, top_k, pinned_from, np.random.default_rng([seed, 2]))
               if policy == "pinned" else [])
    lookups = hits = misses = wasted = 0
    last_lookups = last_hits = 0
    prefill_reads = 0
    cache = make_cache(policy, max(cache_slots, 0), pinned_keys=hottest, pinned_fraction=PINNED_FRACTION)
    if not cold:
        # The engine preloads the pinned experts when it starts; a cold repeat empties the
        # caches after that (engine/run/bench.py), so only a warm run keeps the preload.
        for key in hottest[:int(cache_slots * PINNED_FRACTION)]:
            cache.put(key, True, 1)
    stream = _Stream(tokens_rng, logp, top_k, routing.locality, prompt_tokens) if replay else None
    if replay and prelude_tokens > 0:
        _run_tokens(cache, rng, stream, E, prelude_tokens - 1, lookahead_recall)
    for rep in range(repeats):
        if cold and (rep > 0 or prelude_tokens > 0):
            cache.clear()
        measured = warmup_tokens if (rep == 0 or cold) else 0
        src = stream if replay else _Stream(tokens_rng, logp, top_k, routing.locality, prompt_tokens)
        counts = _run_tokens(cache, rng, src, E, measured + tokens, lookahead_recall, measure_from=measured)
        prefill_reads += counts[0]
        lookups += counts[1]
        hits += counts[2]
        misses += counts[3]
        wasted += counts[4]
        last_lookups, last_hits = counts[1], counts[2]
    measured_tokens = max(tokens * repeats, 1)
    return HitRates(
        decode=hits / lookups if lookups else 0.0,
        prefill_misses_per_layer=prefill_reads / (repeats * L),
        decode_misses_per_token=misses / measured_tokens,
        wasted_prefetch_per_token=wasted / measured_tokens,
        decode_last=last_hits / last_lookups if last_lookups else 0.0,
    )


class _Stream:
    """One prompt's routing and its continuation's, drawn lazily and kept, so a replay asks the
    same experts in the same order."""

    def __init__(self, rng, logp, top_k: int, locality: float, prompt_tokens: int):
        self.rng, self.logp, self.k, self.locality = rng, logp, top_k, locality
        L = logp.shape[0]
        prev = [None] * L
        self.prompt = []
        for l in range(L):
            picks = [_draw(rng, logp[l], top_k, prev, l, locality) for _ in range(prompt_tokens)]
            prev[l] = picks[-1] if picks else None
            self.prompt.append(picks)
        self._prev = prev
        self.tokens: list[list[list[int]]] = []  # [token][layer] -> experts

    def token(self, t: int) -> list[list[int]]:
        while len(self.tokens) <= t:
            row = []
            for l in range(self.logp.shape[0]):
                chosen = _draw(self.rng, self.logp[l], self.k, self._prev, l, self.locality)
                self._prev[l] = chosen
                row.append(chosen)
            self.tokens.append(row)
        return self.tokens[t]


def _run_tokens(cache, rng, stream: _Stream, E: int, n_tokens: int, recall: float | None,
                measure_from: int = 0) -> tuple[int, int, int, int, int]:
    """The prompt pass (one union of experts per layer, looked up once each), then `n_tokens`
    decode steps; (prompt reads, lookups, hits, misses, wasted lookahead reads) of the measured
    decode steps (from `measure_from` on)."""
    prefill_reads = lookups = hits = misses = wasted = 0
    L = len(stream.prompt)
    for l in range(L):
        union = sorted(set().union(*map(set, stream.prompt[l]))) if stream.prompt[l] else []
        for e in union:
            if cache.get((l, e)) is None:
                prefill_reads += 1
                cache.put((l, e), True, 1)
    for t in range(n_tokens):
        row = stream.token(t)
        count = t >= measure_from
        for l in range(L):
            chosen = row[l]
            for e in chosen:
                hit = cache.get((l, int(e))) is not None
                if count:
                    lookups += 1
                    hits += hit
                    misses += not hit
                if not hit:
                    cache.put((l, int(e)), True, 1)
            if recall is not None:
                wasted += count * _offer_wrong_guesses(rng, cache, l, chosen, E, recall)
    return prefill_reads, lookups, hits, misses, wasted


def _pinned_keys(routing: RoutingModel, top_k: int, routings_per_layer: int | None, rng) -> list:
    if routings_per_layer is None:
        return routing.hottest()
    logp = np.log(routing.popularity)
    counts: dict = {}
    prev = [None] * routing.layers
    for _ in range(max(1, routings_per_layer // max(top_k, 1))):
        for l in range(routing.layers):
            chosen = _draw(rng, logp[l], top_k, prev, l, routing.locality)
            prev[l] = chosen
            for e in chosen:
                counts[(l, int(e))] = counts.get((l, int(e)), 0) + 1
    return hottest_keys(counts)


def _draw(rng, logp_row: np.ndarray, k: int, prev: list, layer: int, locality: float) -> list[int]:
    kept = [e for e in (prev[layer] or []) if rng.random() < locality]
    score = logp_row + rng.gumbel(size=logp_row.shape)
    if kept:
        score[kept] = -math.inf
    need = k - len(kept)
    fresh = np.argpartition(-score, need - 1)[:need] if need else []
    return kept + [int(e) for e in fresh]


def _offer_wrong_guesses(rng, cache, layer: int, chosen: list[int], experts: int, recall: float) -> int:
    """Lookahead guessed `1 - recall` of the set wrong: those experts were read (when not cached)
    and offered to the cache after the layer. Returns how many were read."""
    wrong = rng.binomial(len(chosen), max(0.0, 1.0 - recall))
    others = [e for e in rng.permutation(experts)[:len(chosen) + wrong] if e not in chosen][:wrong]
    read = 0
    for e in others:
        if cache.peek((layer, int(e))) is None:
            read += 1
            cache.put((layer, int(e)), True, 1)
    return read


REAL_MODEL_SKEW = 1.0  # synth's skew 1 matches GLM-5's ~41% reuse and OLMoE's LRU curve (docs/SYNTH.md)


def make_routing(spec: str, geometry: ModelGeometry) -> RoutingModel:
    """`--routing SPEC` (`colibri plan`; the study's warm starts pass the space's histogram or
    "auto"): auto (the geometry's synth skew, else REAL_MODEL_SKEW), uniform, skew[:X], or a
    routing histogram JSON."""
    L, E, K = geometry.moe_layers, geometry.num_experts, geometry.top_k
    skew = geometry.routing_skew
    if spec == "auto":
        return synth_skew(L, E, K, REAL_MODEL_SKEW if skew is None else float(skew))
    if spec == "uniform":
        return uniform(L, E)
    if spec.startswith("skew"):
        _, _, x = spec.partition(":")
        try:
            x = float(x) if x else REAL_MODEL_SKEW
        except ValueError:
            raise ConfigError(f"--routing {spec!r}: expected skew:X with X a number") from None
        if not math.isfinite(x) or x < 0:  # synth's own range for a skew
            raise ConfigError(f"--routing {spec!r}: the skew must be a finite number >= 0")
        return synth_skew(L, E, K, x)
    hist = routing_histogram_load(spec)
    locality = synth_skew(L, E, K, float(skew)).locality if skew is not None else 0.0
    return from_histogram(hist, L, E, locality)
