"""colibri engine: a streaming Mixture-of-Experts inference engine (torch + safetensors).

This package never imports `tuner` or `colibri`; they drive it through its front door,
engine/api (`from engine.api import ...`, the only engine module they import), and, for trials,
through the `colibri bench` subprocess.
"""

__version__ = "0.1.0"
