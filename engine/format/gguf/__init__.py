"""GGUF import: llama.cpp's GGUF files → a Hugging Face bf16 safetensors directory.

reader.py opens single and split files and checks them; dequant.py turns each supported
ggml type into float32; gguf_names.py maps the GGUF metadata and tensor names of each MoE
architecture back to config.json and HF names (undoing llama.cpp's q/k permutation and
expert stacking), each architecture's own names read from its registry record
(engine/arch/architecture.GgufNames); tensors.py plans every tensor to write (items.py) and gpt_oss_experts.py fuses
gpt-oss's experts back (MXFP4 kept as stored); vocab.py rebuilds tokenizer.json; importer.py
writes the directory.
Entry point: `engine.format.gguf.importer.import_gguf` (the `colibri convert model.gguf` hook).
"""

from pathlib import Path

GGUF_MAGIC = b"GGUF"


def is_gguf(path) -> bool:
    """A regular file named *.gguf or starting with the GGUF magic: the convert command's
    dispatch test (a damaged .gguf then gets the GGUF reader's error, not "no such directory").
    Kept here so that asking does not import gguf-py (the CLI imports this at start-up)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False
