"""The search, one way: the model facts (the checkpoint read once, the engine's memory plan) → the
space of engine settings (the knobs' search= metadata) → the trial runner (bench in a sandbox) and
a trial's outcome → the Optuna study (set-up, storage, time budget, preflight, judging,
confirmation) → the assembled TuneResult; tune options and the per-quant-level tune.

Owns: turning a time budget into measured trials and a recommended config.
May import: engine (its public API), tuner.base, tuner.sandbox, tuner.probe, tuner.results, tuner.share,
tuner.costmodel.
"""
