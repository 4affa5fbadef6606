"""The door's bench-side room: the single kernels, operators and readers a benchmark times on its
own (benchmarks/), which the engine's users never call. Everything else comes through
engine/api/__init__.py; a name's home is listed once here, resolved lazily as there.
"""

from __future__ import annotations

from engine.api.lazy import homes, resolver

_HOMES = {
    "engine": "native synth",  # module namespaces: the native kernels, the synth library
    "engine.weights": "fp8",
    "engine.arch.layers": "native_quant_operands rms_norm route",
    "engine.arch.rope": "apply_rope rope_cos_sin rope_inv_freq",
    "engine.arch.router": "fp32_logits",
    "engine.weights.mxfp4": "mxfp4_dequantize mxfp4_quantize",
    "engine.format.container": "FORMAT_NAME FORMAT_VERSION",
    "engine.format.gguf.dequant": "dequantize",
    "engine.format.gguf.importer": "import_gguf",
    "engine.format.gguf.reader": "GGUFModel",
    "engine.format.safetensors_writer": "ShardWriter TensorSpec write_json_atomic",
    "engine.movement.cache": "policies",
    "engine.movement.io": "IOStats IO_MODES ReadPool UringPool direct_window_bytes uring_unavailable",
    "engine.movement.io.trace": "read_trace",
    "engine.movement.slots": "SlotArena",
    "engine.base.hugepages": "mapping_huge_bytes",
    "engine.synth.bpe_tokenizer": "bytes_to_unicode",
    "engine.synth.fp8_writer": "write_fp8_checkpoint",
    "engine.run.bench": "make_cold",  # empties the caches and the page cache (a cold repeat)
}
_HOME = homes(_HOMES)
__all__ = sorted(_HOME)
__getattr__ = resolver(__name__, _HOME)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
