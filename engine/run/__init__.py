"""Running a model: the Engine (placement, prefill, decode), generation (alone, or batched by the
scheduler), bench, `colibri run` as a library call, the run's metrics (the JSON every run/bench
prints), `--model` resolution and `quality` (KL against a reference).

Owns: a whole run, start to finish, and its measured figures.
May import: every other engine package but engine.api (the front door, above it).
"""
