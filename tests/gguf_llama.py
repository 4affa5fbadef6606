"""llama.cpp's own convert_hf_to_gguf.py for the tests, many conversions in one process.

The converter is Python (no llama.cpp build needed): the source tree scripts/build_llama_cpp.sh
unpacks (scripts/setup.sh fetches it with SOURCE_ONLY=1) in $LLAMA_CPP_DIR, else the default
places below. Each conversion as its own process would import torch and transformers again
(seconds each on the CI box), so `convert_all` runs this file once as a script that converts a
list of jobs in turn: the script is re-run per job with runpy, as the command line would, its
imports cached. synth's tokenizers get the pre-tokenizer fallback of benchmarks/peers/peers_convert.py
(the vendored tree stays as shipped).
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# $LLAMA_CPP_DIR, where setup.sh and benchmarks/formats/gguf_roundtrip.py put it, and the dev box's builds.
PLACES = [os.environ.get("LLAMA_CPP_DIR"), "~/.cache/colibri/llama.cpp", "/work/tools/llama.cpp",
          "/work/tools/llama.cpp-gguf"]


def llama_dir() -> Path | None:
    for place in PLACES:
        if place and (Path(place).expanduser() / "src" / "convert_hf_to_gguf.py").is_file():
            return Path(place).expanduser()
    return None


def convert_all(jobs: list[tuple[Path, Path, str]], log: Path, src: Path | None = None) -> None:
    """Convert each (model dir, out .gguf, outtype) with llama.cpp's converter (the tree at `src`,
    default llama_dir()'s); one process."""
    src = src or llama_dir() / "src"
    spec = log.with_suffix(".jobs.json")
    spec.write_text(json.dumps([[str(a), str(b), t] for a, b, t in jobs]))
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, __file__, str(src), str(spec)], stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO)}).returncode
    if rc:
        raise AssertionError(f"llama.cpp's converter failed (exit {rc}):\n{log.read_text()[-3000:]}")


def _main(src: Path, spec: Path) -> int:
    script = src / "convert_hf_to_gguf.py"
    sys.path[:0] = [str(src), str(src / "gguf-py"), str(REPO / "benchmarks" / "peers")]  # as running the script would
    from conversion import base  # noqa: E402  (the converter's own module)
    from peers_convert import install_pre_tokenizer_fallback  # noqa: E402
    install_pre_tokenizer_fallback(base)
    for model, out, outtype in json.loads(spec.read_text()):
        sys.argv = [str(script), model, "--outfile", out, "--outtype", outtype]
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
    return 0



# llama.cpp's GLM vocabulary path (conversion/base.py _set_vocab_glm, for glm4moe and glm-dsa)
# looks these up by name, as GLM's own tokenizer has them.
GLM_SPECIALS = ("[gMASK]", "<|user|>", "<|observation|>")


def write_glm_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """synth's byte-level BPE with GLM's special tokens as its last ids, `vocab_size` in all."""
    # Imported here: run as the converter's script, this module must import nothing of the engine
    # (it could load the installed gguf package before the vendored gguf-py the converter uses).
    from tokenizers import AddedToken

    from engine.synth.bpe_tokenizer import build_tokenizer, tokenizer_config
    tok = build_tokenizer(vocab_size - len(GLM_SPECIALS))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GLM_SPECIALS])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(str(Path(model_dir) / "tokenizer.json"))
    if not (Path(model_dir) / "tokenizer_config.json").exists():
        (Path(model_dir) / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(4096)))


if __name__ == "__main__":
    sys.exit(_main(Path(sys.argv[1]), Path(sys.argv[2])))
