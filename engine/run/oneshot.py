"""`colibri run` as a library call: resolve the model, load the engine, generate, measure."""

from __future__ import annotations

from engine.base.config import EngineConfig
from engine.base.errors import PromptError
from engine.run.generate import Sampler, generate, load_tokenizer, parse_prompt_ids, random_prompt_ids
from engine.run.prefix_cache import load_prompt_file, save_prompt_file
from engine.run.run_metrics import envelope, run_metrics
from engine.run.runtime import Engine


def resolve_prompt(engine: Engine, tokenizer, prompt: str | None, prompt_ids: str | None,
                   prompt_tokens: int | None, seed: int) -> list[int]:
    if prompt is not None:
        if tokenizer is None:
            raise PromptError(f"{engine.checkpoint.directory} has no tokenizer.json: use --prompt-ids or --prompt-tokens")
        ids = tokenizer.encode(prompt).ids
        if not ids:
            raise PromptError("the prompt encodes to zero tokens")
        return ids
    if prompt_ids is not None:
        return parse_prompt_ids(prompt_ids)
    return random_prompt_ids(prompt_tokens or 16, engine.args.vocab_size, seed)


def run_generation(model_dir, config: EngineConfig, *, prompt=None, prompt_ids=None, prompt_tokens=None,
                   max_new_tokens=32, sampler: Sampler | None = None, on_token=None,
                   record_routing: str | None = None, prompt_cache: str | None = None) -> dict:
    """prompt_cache: a KV file (llama.cpp's --prompt-cache): the prompt's longest prefix it holds
    is restored instead of computed, and the prompt's KV is written there after the prefill."""
    # Every position kept (a sliding window's too), so the prompt's KV can be written whole.
    with Engine(model_dir, config, keep_positions=True if prompt_cache else None) as engine:
        if record_routing:
            engine.record_routing()
        tokenizer = load_tokenizer(model_dir)
        ids = resolve_prompt(engine, tokenizer, prompt, prompt_ids, prompt_tokens, sampler.seed if sampler else 0)
        cached = load_prompt_file(engine, prompt_cache, ids) if prompt_cache else None
        gen = generate(engine, ids, max_new_tokens, sampler or Sampler(), on_token=on_token, cached_tokens=cached)
        if prompt_cache and gen.cached_tokens < len(ids) - 1:  # what the file lacked: write it anew
            save_prompt_file(engine, prompt_cache, len(ids))
        result = envelope(engine, str(model_dir))
        result.update(run_metrics(engine, gen))
        result["prompt_ids"] = gen.prompt_ids
        result["output_ids"] = gen.output_ids
        if tokenizer is not None:
            result["text"] = tokenizer.decode(gen.output_ids)
        result["load_seconds"] = engine.load_seconds
        if record_routing:
            engine.save_routing(record_routing)
            result["routing_histogram"] = record_routing
        return result
