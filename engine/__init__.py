"""colibri engine: a streaming Mixture-of-Experts inference engine (torch + safetensors).

This package never imports `tuner`; the tuner drives it through its public API and, for
trials, through the `colibri bench` subprocess.
"""

__version__ = "0.1.0"
