"""The cost model: what a config would do on a machine, without running it.

model_geometry (a model's sizes, from its directory or a geometry-only spec) and hardware (the
probe's figures) feed memplan (the engine's memory plan for a config) and predict (tok/s and the
bound: disk, memory or compute); routing_model (expected experts per token and cache hits); fit
calibrates predict's efficiency factors from a tune's measured trials; calibrated_facts keeps a
model's router facts with the geometry they were measured on; best_config searches the predicted
space; plan_command is `colibri plan` (PlanRequest → PlanResult).

Owns: predictions and their calibration.
May import: engine.api, tuner.base, tuner.probe, tuner.results, tuner.share.
"""
