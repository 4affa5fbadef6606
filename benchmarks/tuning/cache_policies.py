"""RAM-cache hit rates of the expert cache policies at cache sizes around one token's working set.

Experts are asked for in a cycle: every MoE layer once per token, top-k each, so one token's
working set is layers × k entries. A plain LRU smaller than that evicts every expert just
before its next use. This replays tokens drawn from a routing model (the cost model's: synth
--routing-skew popularity and token-to-token locality, tuner/costmodel/routing_model.py) through the
engine's own cache classes, in the order the engine asks, and prints decode hit rates:

  warm   one cache, 64 unmeasured tokens, then 192 measured (steady state)
  cold   8-token prompt + 8 tokens, cache emptied per repeat (the tuner's default trial), 3 repeats

`lru + admission` is LRU with a frequency-admission rule, simulated only: it beats plain LRU
here below one working set, but measured fewer RAM hits on the real demo (docs/BENCHMARKS.md),
so the engine's `lru` stays plain.

  .venv/bin/python benchmarks/tuning/cache_policies.py --skew 1.0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.api.lab import policies  # noqa: E402
from tuner.costmodel import routing_model as routing  # noqa: E402
from benchmarks.benchkit import conditions, emit  # noqa: E402

SLOT_FACTORS = (0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)  # × one token's working set
POLICIES = ("lru", "lru + admission", "lfu", "pinned")


class AdmissionLRU(policies.LRUCache):
    """LRU with frequency admission (as in TinyLFU): a newcomer that would push out the least
    recently used entry is taken only if asked for strictly more often (or the victim was never
    asked for). Simulated here only: on the real demo under 1 GiB it measured fewer RAM hits
    than plain LRU (docs/BENCHMARKS.md), so the engine's lru stays plain."""

    def _admits(self, key, nbytes):
        if self.bytes_used + nbytes <= self.capacity_bytes or not self._order:
            return True  # room without evicting: always
        victim = self._requests[next(iter(self._order))]
        return victim == 0 or self._requests[key] > victim


def _make_cache(policy, capacity, **kw):
    return AdmissionLRU(capacity) if policy == "lru + admission" else policies.make_cache(policy, capacity, **kw)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="MoE layers (demo: 16)")
    p.add_argument("--experts", type=int, default=64, help="experts per layer (demo: 64)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (demo: 8)")
    p.add_argument("--skew", type=float, default=1.0, help="synth --routing-skew (demo: 1.0)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    routing.make_cache = _make_cache  # the simulation builds caches by name; add the variant
    model = routing.synth_skew(args.layers, args.experts, args.top_k, args.skew)
    working_set = args.layers * args.top_k
    rows = []
    for factor in SLOT_FACTORS:
        slots = max(1, round(factor * working_set))
        row = {"slots": slots, "factor": factor}
        for policy in POLICIES:
            warm = routing.simulate(model, args.top_k, slots, policy, cold=False, warmup_tokens=64, tokens=192,
                                    seed=args.seed).decode
            cold = routing.simulate(model, args.top_k, slots, policy, cold=True, prompt_tokens=8, tokens=8,
                                    repeats=3, seed=args.seed).decode
            row[policy] = {"warm": warm, "cold": cold}
        rows.append(row)
    cond = conditions(layers=args.layers, experts=args.experts, top_k=args.top_k, routing=model.description,
                      working_set=working_set, seed=args.seed,
                      measured="decode hit rate warm (64 + 192 tokens) / cold (8 + 8 tokens, 3 repeats)")
    columns = [("cache entries", lambda r: r["slots"]), ("× working set", lambda r: f"{r['factor']:g}")]
    columns += [(pol, lambda r, pol=pol: f"{100 * r[pol]['warm']:.1f}% / {100 * r[pol]['cold']:.1f}%")
                for pol in POLICIES]
    emit("cache_policies", rows, cond, args.json, columns)
    return 0

if __name__ == "__main__":
    sys.exit(main())
