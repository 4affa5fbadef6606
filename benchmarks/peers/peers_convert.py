"""Run llama.cpp's own convert_hf_to_gguf.py on a colibri-synth model, without editing llama.cpp.

    python benchmarks/peers/peers_convert.py --llama-src /work/tools/llama.cpp/src MODEL_DIR --outfile X.gguf --outtype bf16

Everything after --llama-src goes to the converter unchanged.

Why a wrapper: the converter identifies a BPE tokenizer's pre-tokenizer by hashing the tokens it
gives for a fixed test string and looking the hash up in a table of known models. A tokenizer
trained by `synth` (engine/synth/bpe_tokenizer.py) has its own merges, so its hash is in no table and
the converter stops with "BPE pre-tokenizer was not recognized". Its pre-tokenizer is GPT-2's
regex (tokenizers' ByteLevel with use_regex=True), which llama.cpp implements under the name
"gpt-2". So the wrapper replaces `TextModel.get_vocab_base_pre` with one that asks the original
first and, only when the original refuses the hash AND the model directory's
tokenizer_config.json says it is a colibri-synth byte-level BPE, answers "gpt-2". Any other
model keeps the converter's refusal. The vendored tree stays byte-for-byte as shipped.
"""

from __future__ import annotations

import json
import logging
import runpy
import sys
from pathlib import Path

PRE_TOKENIZER = "gpt-2"  # llama.cpp's name for GPT-2's pre-tokenizer regex


def is_colibri_bpe(model_dir: Path) -> bool:
    try:
        cfg = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and (cfg.get("colibri_tokenizer") or {}).get("kind") == "byte-level-bpe"


def install_pre_tokenizer_fallback(base_module) -> None:
    """Wrap the converter's hash lookup so that colibri-synth tokenizers map to gpt-2."""
    original = base_module.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not is_colibri_bpe(self.dir_model):
                raise
            logging.getLogger("peers_convert").warning(
                "colibri-synth byte-level BPE: unknown pre-tokenizer hash mapped to %r", PRE_TOKENIZER)
            return PRE_TOKENIZER

    base_module.TextModel.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--llama-src":
        print("usage: peers_convert.py --llama-src LLAMA_CPP_SRC MODEL_DIR [converter options]", file=sys.stderr)
        return 2
    src = Path(argv[1]).resolve()
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        print(f"error: {script} not found (build llama.cpp with scripts/build_llama_cpp.sh)", file=sys.stderr)
        return 2
    # What running the script directly would put first on sys.path, plus its bundled gguf package.
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion import base  # the converter's own module; the script imports the same object
    install_pre_tokenizer_fallback(base)
    sys.argv = [str(script), *argv[2:]]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
