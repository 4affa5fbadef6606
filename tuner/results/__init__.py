"""Results: the one typed result schema (trial_record.py: a run's figures and a trial; result.py: the
tune result and its migration), the one column registry derived from the dataclasses (columns.py),
the published JSON Schemas (schema.py), every printer (text, markdown, CSV and html tables from one
pandas frame, JSON), the files a run leaves (outputs.py), report.md/.html and their plots, and run
directories read back (rundir.py, quant_rundir.py).

Owns: what a tune produced and every way of showing it.
May import: engine.api (the engine's front door), tuner.base, tuner.probe.
"""
