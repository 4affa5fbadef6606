"""The search: the space of engine settings, the trial runner (bench in a sandbox), a trial's outcome,
the Optuna study (storage, time budget, preflight, judging, confirmation), tune options and the
per-quant-level tune.

Owns: turning a time budget into measured trials and a recommended config.
May import: engine (its public API), tuner.probe, tuner.sandbox, tuner.costmodel, tuner.results.
"""
