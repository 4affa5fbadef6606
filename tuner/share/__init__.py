"""Sharing: shareable hardware profiles (export without identity, strict import, the local store, show,
diff) and `compare` (runs and profiles side by side).

Owns: what leaves this machine and what comes back from others.
May import: engine.api, tuner.base, tuner.probe, tuner.results.
"""
