"""Results: the one typed result schema (result.py), its strict JSON loader and JSON Schemas (schema.py),
every printer (text, markdown, CSV, JSON), the files a run leaves (outputs.py), report.md/.html and
their plots, and a run directory read back (rundir.py).

Owns: what a tune produced and every way of showing it.
May import: engine.base, engine.run.metrics, tuner.probe.
"""
