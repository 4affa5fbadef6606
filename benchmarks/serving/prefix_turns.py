"""A conversation through serve's worker (no HTTP): time to first token per turn with prefix reuse
off, on, and on again after a restart (a new engine on the same KV directory, RAM empty).

Each turn appends --user-words of user text (words drawn from a fixed list, seeded) to the
history and asks for --answer-tokens (greedy); the history is rendered through the model's chat
template, as `colibri serve` does, so every turn resends everything before it. The restart pass
replays the same conversation: its first turns find their prefix in the files the first "on"
pass left in --kv-dir when it closed.

    .venv/bin/python benchmarks/serving/prefix_turns.py --model tiny --turns 10
    .venv/bin/python benchmarks/serving/prefix_turns.py --model demo --ram-budget 1GiB --turns 10 --json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORDS = ("disk stream expert layer cache token prompt model answer question memory budget read "
         "write block prefix history turn agent tool result reuse restore").split()


def conversation(model, turns: int, user_words: int, answer_tokens: int, seed: int) -> list[dict]:
    from colibri.serve.protocol import Sampling
    from colibri.serve.worker import Job
    rng = random.Random(seed)
    history, rows = [], []
    for turn in range(turns):
        text = " ".join(rng.choice(WORDS) for _ in range(user_words))
        history.append({"role": "user", "content": text})
        ids = model.tokenizer.encode(model.template.render(history, add_generation_prompt=True),
                                     add_special_tokens=False).ids
        done, box = threading.Event(), []
        job = Job(ids, Sampling(max_tokens=answer_tokens, temperature=0.0, top_p=1.0, seed=0, stop=[]),
                  lambda kind, value: (box.append(value), done.set()) if kind == "done" else None)
        model.worker.submit(job)
        done.wait()
        result = box[0]
        if result.generation is None:
            raise SystemExit(f"turn {turn + 1}: {result.finish_reason}: {result.error}")
        gen = result.generation
        rows.append({"turn": turn + 1, "prompt_tokens": len(ids), "cached_tokens": result.cached_tokens,
                     "ttft_s": round(gen.ttft_seconds, 4)})
        history.append({"role": "assistant", "content": result.text})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="model directory or synth preset")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--user-words", type=int, default=48, help="words of user text per turn (~200 tokens on the synth tokenizer)")
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--ctx-size", type=int, default=8192)
    p.add_argument("--ram-budget", default="0")
    p.add_argument("--prefix-cache", default="256MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    from engine.api import EngineConfig, parse_size, resolve_model
    from colibri.serve.server import LoadedModel
    model_dir = resolve_model(a.model, progress=False)
    base = EngineConfig(ctx_size=a.ctx_size, ram_budget=parse_size(a.ram_budget))
    passes = {}
    with tempfile.TemporaryDirectory(prefix="kv-") as kv_dir:
        for name, prefix in (("off", 0), ("on", parse_size(a.prefix_cache)), ("after restart", parse_size(a.prefix_cache))):
            model = LoadedModel(model_dir, base.replace(prefix_cache=prefix), queue_size=1,
                                kv_dir=kv_dir if prefix else None, kv_disk_bytes=8 << 30 if prefix else 0)
            try:
                passes[name] = conversation(model, a.turns, a.user_words, a.answer_tokens, a.seed)
            finally:
                model.close()
    if a.json:
        print(json.dumps({"model": str(model_dir), "config": base.to_dict(), "passes": passes}, indent=1))
        return 0
    print(f"{model_dir.name}, ctx {a.ctx_size}, budget {a.ram_budget}, {a.user_words} words/turn, "
          f"{a.answer_tokens} answer tokens, greedy")
    print("| turn | prompt tokens | TTFT off (s) | TTFT on (s) | cached on | TTFT after restart (s) | cached |")
    print("|---|---|---|---|---|---|---|")
    for off, on, again in zip(passes["off"], passes["on"], passes["after restart"]):
        print(f"| {off['turn']} | {off['prompt_tokens']} | {off['ttft_s']:.3f} | {on['ttft_s']:.3f} | "
              f"{on['cached_tokens']} | {again['ttft_s']:.3f} | {again['cached_tokens']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
