"""One greedy generation with transformers, disk-offloaded by accelerate or fully resident; prints one JSON line.

    python benchmarks/peers/peers_hf.py --model DIR --prompt TEXT --tokens N --threads T
                                  (--offload-dir DIR | --resident) [--cap-seconds S]

benchmarks/peers/peers.py runs this inside the memory cgroup. Disk offload is accelerate's, as
`from_pretrained(device_map={"": "disk"}, offload_folder=...)` sets it up: every module's
weights live on disk and accelerate's hooks load them for each forward pass (the
checkpoint's own safetensors where a tensor is stored as the model wants it; experts, which
transformers fuses on load, are written once to the offload folder). The per-token clock is a
StoppingCriteria, called once per generated token; it also stops generation at the wall-time
cap, so a very slow peer reports what it measured instead of running for hours.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--offload-dir")
    where.add_argument("--resident", action="store_true")
    p.add_argument("--cap-seconds", type=float, default=None, help="stop generating after this much wall time")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
    torch.set_num_threads(args.threads)

    t_load = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    kwargs = {"dtype": "auto"}
    if not args.resident:
        kwargs.update(device_map={"": "disk"}, offload_folder=args.offload_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    model.eval()
    # Same token count for every engine: generation must not end early at an EOS the random model samples.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    load_s = time.perf_counter() - t_load

    stamps: list[float] = []

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            stamps.append(time.perf_counter())
            over = args.cap_seconds is not None and stamps[-1] - t0 > args.cap_seconds
            return torch.full((input_ids.shape[0],), over, dtype=torch.bool)

    prompt_ids = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompt_ids, max_new_tokens=args.tokens, do_sample=False,
                             stopping_criteria=StoppingCriteriaList([Clock()]))
    new = out[0, prompt_ids.shape[1]:].tolist()
    ttft = stamps[0] - t0 if stamps else None
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
    print(json.dumps({
        "load_s": load_s, "ttft_s": ttft, "decode_tok_s": decode,
        "prompt_ids": prompt_ids[0].tolist(), "output_ids": new,
        "stopped_at_cap": len(new) < args.tokens,
        "mode": "resident" if args.resident else "accelerate disk offload",
        "dtype": str(next(iter(model.state_dict().values())).dtype),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
