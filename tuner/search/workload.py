"""What a tune's trials run: the fixed random prompt, or the user's prompts (`tune --prompts`).

    work = prepare_workload(opts.prompts, model_dir, ...); ...; work.save(out)
    run_trial(..., extra_args=work.bench_args)      # every trial and the calibration run
    work.info                                         # result.json's `workload` (lengths + hash)

The user's file is parsed and tokenized once, up front (a bad file is one error line before
anything slow), and saved tokenized in the run directory (workload.jsonl), so every trial, the
calibration run that records the routing histogram for `pinned` and the cost model, and a
resumed run all read the same requests even if the user's file changes meanwhile. What leaves
the run directory (result.json, the profile entry) describes the workload by its lengths and a
hash, never its text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.api import ConfigError, Request, describe, load_tokenizer, load_workload, save_requests
from tuner.results.result import Lengths, WorkloadInfo

WORKLOAD_FILE = "workload.jsonl"


@dataclass
class TuneWorkload:
    info: WorkloadInfo
    requests: list[Request] = field(default_factory=list)  # empty: the fixed prompt
    bench_args: list[str] = field(default_factory=list)  # what `colibri bench` is given for it

    @property
    def ctx_needed(self) -> int:
        """The context the longest request needs (prompt + its output); 0 for the fixed prompt."""
        return max((r.tokens for r in self.requests), default=0)

    @property
    def digest(self) -> str | None:
        return self.info.sha256

    def save(self, out: Path) -> None:
        """Write the tokenized requests into the run directory; trials read that copy."""
        if self.requests:
            path = save_requests(self.requests, Path(out) / WORKLOAD_FILE).resolve()
            self.bench_args = ["--workload", str(path)]


def fixed_info(prompt_tokens: int, tokens: int) -> WorkloadInfo:
    one = lambda n: Lengths(min=n, median=n, max=n, total=n)  # noqa: E731
    return WorkloadInfo(kind="fixed", requests=1, prompt_tokens=one(prompt_tokens), max_new_tokens=one(tokens),
                        sha256=None)


def prepare_workload(prompts: str | None, model_dir: Path, prompt_tokens: int, tokens: int,
                     max_position_embeddings: int) -> TuneWorkload:
    """The fixed prompt (prompts None), or the user's file tokenized (`save` it once the run
    directory exists)."""
    if prompts is None:
        return TuneWorkload(fixed_info(prompt_tokens, tokens))
    requests = load_workload(prompts, load_tokenizer(model_dir), tokens)
    longest = max(r.tokens for r in requests)
    if longest > max_position_embeddings:
        raise ConfigError(f"--prompts {prompts}: a request of {longest} tokens (prompt + max_new_tokens) is longer "
                          f"than the model's {max_position_embeddings} positions")
    d = describe(requests)
    info = WorkloadInfo(kind="prompts", requests=d["requests"], prompt_tokens=Lengths(**d["prompt_tokens"]),
                        max_new_tokens=Lengths(**d["max_new_tokens"]), sha256=d["sha256"],
                        source=Path(prompts).name)
    return TuneWorkload(info, requests)
