"""The steady-decoding workload: several prompts, each decoded long enough to cycle the cache.

    requests = steady_requests(vocab, n=3, prompt_tokens=8, tokens=32, seed=0, tokenizer=tok)
    result = run_steady_bench(engine, requests, ...)      # `colibri bench --steady 3`

Why: one short prompt measures that prompt. A random model's greedy output easily falls into a
loop (one token repeated), which routes to the same experts every step and fills the cache with
them: the figure is then a cache-hit figure no user sees (issue 43: 27.8 tok/s reported, 15.8
re-measured). So the workload is N prompts of different lengths and seeds, each decoded with a
seeded sampler (every config draws the same tokens: placement never changes the logits, and the
sampler's generator is seeded per prompt), and the first quarter of each prompt's decode is not
counted (it refills the cache after the prompt's prefill; the tune sizes `tokens` at a few cache
cycles, tuner/search/workload.py). A prompt whose output degenerates (a token or a short cycle
repeated) is reported and left out of the figure. The figure is the median over the prompts;
the spread over them is `summary`.

Everything is a function of (vocab, n, prompt_tokens, tokens, seed, temperature, top_p, the
tokenizer): the same flags give the same token ids on every machine (a fixed word list, not
the interpreter's own files, is the text).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics

import torch

from engine.run.generate import Generation, Sampler, generate
from engine.run.prompts_file import Request, workload_digest
from engine.run.run_metrics import SUMMARY_KEYS, percentile, run_metrics, spread

# Defaults of the steady workload (tune's and `bench --steady`'s): sampled, because greedy
# decoding of a random-weight model degenerates; top-p trims the tail as chat defaults do.
STEADY_TEMPERATURE = 1.0
STEADY_TOP_P = 0.95
STEADY_WARM_SHARE = 0.25  # of each prompt's decode tokens, refilling the cache after its prefill: not counted
MAX_PERIOD = 16  # a cycle this short or shorter, repeated (twice at least) over the output's second half, is degenerate
MIN_JUDGED = 8  # outputs shorter than this are too short to call a loop

# Plain English words: the prompts' text where the model has a tokenizer. Fixed here (not read
# from the system) so the token ids are the same wherever the command runs.
WORDS = tuple("""the a of to and in is it you that he was for on are with as his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing see
him two has look more day could go come did number sound no most people my over know water than call
first who may down side been now find any new work part take get place made live where after back little
only round man year came show every good me give our under name very through just form sentence great
think say help low line differ turn cause much mean before move right boy old too same tell does set three
want air well also play small end put home read hand port large spell add even land here must big high such
follow act why ask men change went light kind off need house picture try us again animal point mother world
near build self earth father head stand own page should country found answer school grow study still learn
plant cover food sun four between state keep eye never last let thought city tree cross farm hard start
might story saw far sea draw left late run while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those both mark often letter until
mile river car feet care second book carry took science eat room friend began idea fish mountain stop once
base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red list
though feel talk bird soon body dog family direct pose leave song measure door product black short numeral
class wind question happen complete ship area half rock order fire south problem piece told knew pass since
top whole king space heard best hour better true during hundred five remember step early hold west ground
interest reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay
against pattern slow center love person money serve appear road map rain rule govern pull cold notice voice
unit power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing course stay
wheel full force blue object decide surface deep moon island foot system busy test record boat common gold
possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire
bring yes distant fill east paint language among""".split())


def request_seed(seed: int, i: int) -> int:
    """Prompt i's seed (its text and its sampler): distinct for every (seed, i) below 2**20 prompts,
    so seed 1's prompts are not seed 0's shifted by one."""
    return (seed * 1_048_573 + i * 7_919 + 1) % (2 ** 31)


def prompt_lengths(n: int, prompt_tokens: int) -> list[int]:
    """n lengths from half to one and a half times prompt_tokens (median prompt_tokens): prompts of
    different lengths route differently in prefill, and the cache state they leave differs."""
    if n == 1:
        return [prompt_tokens]
    return [max(1, round(prompt_tokens * (0.5 + i / (n - 1)))) for i in range(n)]


def steady_requests(vocab: int, n: int, prompt_tokens: int, tokens: int, seed: int, tokenizer=None) -> list[Request]:
    """The workload's requests: text through the tokenizer where there is one (and its ids fit the
    model's vocabulary), else seeded random token ids."""
    out = []
    for i, length in enumerate(prompt_lengths(n, prompt_tokens)):
        out.append(Request(tuple(_prompt(vocab, length, request_seed(seed, i), tokenizer)), tokens))
    return out


def _prompt(vocab: int, length: int, seed: int, tokenizer) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    if tokenizer is not None:
        ids: list[int] = []
        while len(ids) < length:
            words = [WORDS[int(k)] for k in torch.randint(0, len(WORDS), (4 * length + 8,), generator=g)]
            ids += tokenizer.encode(" ".join(words)).ids
            if not ids:
                break
        ids = ids[:length]
        if len(ids) == length and all(0 <= t < vocab for t in ids):
            return ids
        g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def degenerate(ids: list[int], max_period: int = MAX_PERIOD) -> dict | None:
    """{'period': p, 'from': index} when the output's second half repeats a cycle of p <= max_period
    tokens (p = 1: one token repeated), else None. Outputs shorter than MIN_JUDGED are not judged."""
    n = len(ids)
    if n < MIN_JUDGED:
        return None
    tail_from = n // 2
    for p in range(1, max_period + 1):
        if n - tail_from < 2 * p:
            break
        if all(ids[j] == ids[j - p] for j in range(tail_from + p, n)):
            start = tail_from
            while start - 1 - p >= 0 and ids[start - 1] == ids[start - 1 - p]:
                start -= 1  # where the loop began, for the report
            return {"period": p, "from": max(0, start - p)}
    return None


def run_steady_bench(engine, requests: list[Request], *, repeats: int, cold: bool, seed: int, temperature: float,
                     top_p: float, make_cold, reset_stats, progress=None) -> dict:
    """Each repeat runs every prompt in order (cold: from an empty cache and page cache at the
    repeat's start); each prompt's figures are over its decode after the warm share, medians over
    the repeats. The figure: the median over the prompts that did not degenerate."""
    per_repeat: list[list[dict]] = []
    cold_how = None
    for rep in range(repeats):
        if cold:
            cold_how = make_cold(engine)
        reset_stats(engine)
        per_repeat.append([_one(engine, r, Sampler(temperature, top_p, request_seed(seed, i)), reset_stats)
                           for i, r in enumerate(requests)])
        if progress:
            progress(rep + 1, repeats, _aggregate(per_repeat[-1:])[0])
    prompts = _per_prompt(per_repeat)
    counted = counted_prompts(prompts)
    result = {
        "cold": cold, "cold_method": cold_how, "repeats": repeats, "seed": seed,
        "tokens": sum(r.max_new_tokens for r in requests), "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
        "workload": {"kind": "steady", "requests": len(requests), "sha256": workload_digest(requests),
                     "temperature": temperature, "top_p": top_p, "warm_share": STEADY_WARM_SHARE,
                     "degenerate": sum(p["degenerate"] is not None for p in prompts),
                     "all_degenerate": all(p["degenerate"] is not None for p in prompts)},
        "prompts": [{k: v for k, v in p.items() if k != "output_ids"} for p in prompts],
        "runs": counted,  # one per counted prompt (medians over the repeats): the spread is over prompts
        "summary": {k: spread([p.get(k) for p in counted]) for k in SUMMARY_KEYS},
        "output_ids": [t for p in prompts for t in p["output_ids"]],
        "output_sha256": _ids_digest([p["output_ids"] for p in prompts]),
        "tokens_consistent": all([x["output_ids"] for x in rep] == [x["output_ids"] for x in per_repeat[0]]
                                 for rep in per_repeat),
    }
    for k in SUMMARY_KEYS:
        result[k] = result["summary"][k]["median"]
    for k in ("bytes_read_per_token", "cpu_s_per_token", "measured_tokens"):
        result[k] = _median([p.get(k) for p in counted])
    result["hit_rate"] = {"ram": _median([(p.get("hit_rate") or {}).get("ram") for p in counted])}
    last = per_repeat[-1][-1]
    for k, v in last.items():  # the memory and I/O facts as they stand at the end (peak RSS, io mode)
        result.setdefault(k, v)
    return result


def counted_prompts(prompts: list[dict]) -> list[dict]:
    """The prompts the figure is the median over: those whose output did not loop. When every one
    loops there is nothing else to measure: all of them, and the result says `all_degenerate`."""
    return [p for p in prompts if p["degenerate"] is None] or prompts


def _one(engine, request: Request, sampler: Sampler, reset_stats) -> dict:
    warm = int(request.max_new_tokens * STEADY_WARM_SHARE)
    mark: list[float] = []
    seen = [0]

    def on_token(_token):
        seen[0] += 1
        if seen[0] == warm + 1:  # prefill and the warm share done: the counters start here
            reset_stats(engine)
            mark.append(_cpu_seconds())

    gen = generate(engine, list(request.prompt_ids), request.max_new_tokens, sampler, on_token=on_token)
    steps = gen.token_seconds[warm:]
    window = Generation(gen.prompt_ids, gen.output_ids, gen.prefill_seconds, gen.ttft_seconds, steps)
    m = run_metrics(engine, window)
    m["request_s"] = gen.ttft_seconds + sum(gen.token_seconds)
    m["token_latency_p50_ms"] = percentile(steps, 0.5) * 1000.0 if steps else None
    m["token_latency_p99_ms"] = percentile(steps, 0.99) * 1000.0 if steps else None
    m["measured_tokens"] = len(steps)
    m["bytes_read_per_token"] = m.get("bytes_read", 0) / len(steps) if steps else None
    m["cpu_s_per_token"] = (_cpu_seconds() - mark[0]) / len(steps) if mark and steps else None
    m["output_ids"] = list(gen.output_ids)
    return m


def _per_prompt(per_repeat: list[list[dict]]) -> list[dict]:
    """Each prompt's figures: medians over the repeats; its loop (if any) judged on its output."""
    out = []
    for i in range(len(per_repeat[0])):
        reps = [rep[i] for rep in per_repeat]
        p = {k: _median([r.get(k) for r in reps]) for k in (*SUMMARY_KEYS, "bytes_read_per_token", "cpu_s_per_token",
                                                           "measured_tokens")}
        p["hit_rate"] = {"ram": _median([(r.get("hit_rate") or {}).get("ram") for r in reps])}
        p.update(index=i, prompt_tokens=reps[0]["prompt_tokens"], generated_tokens=len(reps[0]["output_ids"]),
                 output_ids=reps[0]["output_ids"], degenerate=degenerate(reps[0]["output_ids"]))
        out.append(p)
    return out


def _aggregate(per_repeat: list[list[dict]]) -> list[dict]:
    return [{"decode_tok_s": _median([x.get("decode_tok_s") for x in per_repeat[-1]])}]


def _median(values):
    vals = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(vals) if vals else None


def _ids_digest(outputs: list[list[int]]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(outputs, separators=(",", ":")).encode()).hexdigest()[:16]


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system
