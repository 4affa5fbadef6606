"""Two parts of `colibri serve` measured without HTTP: the streamed text's cost per token, and the
first request's TTFT on the worker thread against the same engine's first request elsewhere.

detok: serve's TextStream (colibri/serve/worker.py) turning a long output into streamed pieces, in
this tree and in --before-src (a revision or a directory), rounds alternating which goes first.
The ids are the demo tokenizer's encoding of real text (Python's own textwrap.py, then a line of
accented, CJK and emoji text, repeated to --tokens), pushed one at a time as the worker pushes
them, with one 4-character stop string that never matches (a held-back tail, as a request with
`stop` has). Per token: the median µs of the first and the last 64 pushes, and the total.

first-request: a fresh process per run loads the engine (--config) and times one request's TTFT
(prefill + the first token) and its read stall, as `colibri run` does it (the main thread), on a
new thread, through serve's GenerationWorker (its thread, its job queue), and on the main thread
after an idle pause like the one between a server's start and its first request.

    .venv/bin/python benchmarks/serving/serve_parts.py detok --before-src s21-start --tokens 512 --rounds 3
    .venv/bin/python benchmarks/serving/serve_parts.py first-request --config benchmarks/serving/serve_demo_1GiB.toml --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STOP = "\x00\x01\x02\x03"  # never in the text: the stop's hold is paid, the stop never cuts
MIXED = "\nnaïve café, 日本語のテキスト, emoji 🙂🦙 and ß€ — across tokens.\n"
PROMPT = "The streaming engine reads the routed experts of each layer from the disk, and"
VARIANTS = ("main", "thread", "worker", "main-after-idle")


def _ids(tokenizer, n: int) -> list[int]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:6000] + MIXED
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text, add_special_tokens=False).ids
    return ids[:n]


def detok_child(a) -> dict:
    from engine.api import load_tokenizer
    from colibri.serve.worker import TextStream
    tokenizer = load_tokenizer(a.model_dir)
    ids = _ids(tokenizer, a.tokens)
    stream = TextStream(tokenizer, [STOP])
    times, pieces = [], []
    for t in ids:
        t0 = time.perf_counter_ns()
        pieces.append(stream.push(t))
        times.append(time.perf_counter_ns() - t0)
    pieces.append(stream.flush())
    text = "".join(pieces)
    return {"tokens": len(ids), "total_ms": sum(times) / 1e6,
            "first64_us": statistics.median(times[:64]) / 1e3, "last64_us": statistics.median(times[-64:]) / 1e3,
            "text_sha256": hashlib.sha256(text.encode()).hexdigest()[:16], "chars": len(text),
            "equals_whole_decode": text == tokenizer.decode(ids)}


def first_request_child(a) -> dict:
    from engine.api import EngineConfig
    from engine.api import Sampler, generate
    from colibri.serve.protocol import Sampling
    from colibri.serve.server import LoadedModel
    from colibri.serve.worker import Job
    config = EngineConfig.load(a.config) if a.config else EngineConfig()
    t0 = time.perf_counter()
    model = LoadedModel(a.model_dir, config, queue_size=1)  # what serve loads; its worker idles unless used
    load_s = time.perf_counter() - t0
    try:
        engine = model.engine
        ids = model.tokenizer.encode(PROMPT).ids
        before = engine.io_stats()
        if a.variant == "worker":
            done, box = threading.Event(), []

            def emit(kind, value):
                if kind == "done":
                    box.append(value)
                    done.set()

            model.worker.submit(Job(ids, Sampling(max_tokens=2, temperature=0.0, top_p=1.0, seed=0), emit))
            if not done.wait(600):
                raise SystemExit("the worker did not finish the request in 10 minutes")
            gen = box[0].generation
        elif a.variant == "thread":
            box = []
            th = threading.Thread(target=lambda: box.append(generate(engine, ids, 2, Sampler())))
            th.start()
            th.join()
            gen = box[0]
        else:
            if a.variant == "main-after-idle":
                time.sleep(a.idle)  # the server's wait for its first client, on purpose
            gen = generate(engine, ids, 2, Sampler())
        after = engine.io_stats()
        stall = (after.get("io_stall_s") or 0) - (before.get("io_stall_s") or 0)
        read = (after.get("bytes_read") or 0) - (before.get("bytes_read") or 0)
        return {"variant": a.variant, "load_s": load_s, "ttft_s": gen.ttft_seconds, "prefill_s": gen.prefill_seconds,
                "stall_s": stall, "mib_read": read / 2**20, "prompt_tokens": len(ids), "first_id": gen.output_ids[0]}
    finally:
        model.close()


def _child(args: list[str], tree: Path = ROOT) -> dict:
    from benchmarks.trees import tree_env
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *args], cwd=tree,
                         env=tree_env(tree), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"serve_parts: child failed in {tree}: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("detok", "first-request"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="demo", help="model directory or synth preset (default demo)")
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=512, help="detok: output length in tokens")
    p.add_argument("--before-src", help="detok: the tree to compare (a revision or a directory)")
    p.add_argument("--config", help="first-request: engine config TOML")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--idle", type=float, default=2.0, help="first-request: seconds of idle before main-after-idle")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.child:
        json.dump(detok_child(a) if a.part == "detok" else first_request_child(a), sys.stdout)
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks import benchkit
    from benchmarks.trees import source_tree
    from engine.api import resolve_model
    model_dir = str(resolve_model(a.model))
    rows = []
    if a.part == "detok":
        if not a.before_src:
            return benchkit.refuse("serve_parts", "detok needs --before-src (a revision or a directory)")
        with source_tree(a.before_src) as before:
            sides = [("after", ROOT), ("before", before)]
            for r in range(a.rounds):
                for side, tree in sides if r % 2 == 0 else sides[::-1]:
                    row = _child(["detok", "--model-dir", model_dir, "--tokens", str(a.tokens)], tree)
                    rows.append({"round": r + 1, "side": side, **row})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        columns = [("round", lambda r: r["round"]), ("side", lambda r: r["side"]), ("tokens", lambda r: r["tokens"]),
                   ("µs/token, first 64 (median)", lambda r: round(r["first64_us"], 1)),
                   ("µs/token, last 64 (median)", lambda r: round(r["last64_us"], 1)),
                   ("total ms", lambda r: round(r["total_ms"], 1)), ("text sha256", lambda r: r["text_sha256"]),
                   ("= whole decode", lambda r: r["equals_whole_decode"])]
        cond = benchkit.conditions(model=a.model, tokens=a.tokens, rounds=a.rounds, before=a.before_src)
    else:
        for r in range(a.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                row = _child(["first-request", "--model-dir", model_dir, "--variant", variant, "--idle", str(a.idle),
                              *(["--config", str(Path(a.config).resolve())] if a.config else [])])
                rows.append({"round": r + 1, **row})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        columns = [("round", lambda r: r["round"]), ("variant", lambda r: r["variant"]),
                   ("load s", lambda r: round(r["load_s"], 2)), ("TTFT s", lambda r: round(r["ttft_s"], 3)),
                   ("read stall s", lambda r: round(r["stall_s"], 3)), ("MiB read", lambda r: round(r["mib_read"], 1)),
                   ("prompt tokens", lambda r: r["prompt_tokens"]), ("first id", lambda r: r["first_id"])]
        cond = benchkit.conditions(model=a.model, config=a.config, rounds=a.rounds, idle_s=a.idle)
    benchkit.emit("serve_parts", rows, cond, a.json, columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
