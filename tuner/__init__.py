"""colibri tuner: probe the machine, search engine settings, report and share results."""

__version__ = "0.1.0"
