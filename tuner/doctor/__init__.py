"""`colibri doctor`: a preflight that reads the machine, the model and a probe, and says for each
finding the measured symptom, its likely cause and the fix, with a one-line verdict.

Owns: facts.py (the readings) and rules.py (pure rules: Facts → findings).
May import: engine (its public API), tuner.sandbox, tuner.probe, tuner.results.printers.
"""
