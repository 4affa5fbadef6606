#!/usr/bin/env bash
# One-shot set-up on a fresh Debian-like machine: fio from apt (when missing and we may
# install it), a virtual environment in .venv, the CPU torch wheel, and this package.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

# fio for the probe; PostgreSQL for the multi-worker tune test; Chromium for the report's
# browser check (tests/test_report_html.py; both tests skip, saying why, without them); g++
# for the native bf16 decode kernels (engine/native: without it torch's matmuls are used).
missing=()
command -v fio >/dev/null 2>&1 || missing+=(fio)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing ${missing[*]} from apt" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "setup: ${missing[*]} missing and cannot apt-get; probe uses its Python fallback, the PostgreSQL and browser tests skip" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
# torch first and pinned, before anything that depends on it (an unpinned torch pulled in by
# another package would be a multi-GB CUDA build). What makes 2.13.0 the CPU build: on this
# project's machines pip's configured index holds the CPU wheel of exactly that version; on a
# stock machine PyPI's Linux wheel is the CUDA one, so there set
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# (PyTorch's CPU-only index). Either way the check below refuses a CUDA build.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    echo "setup: installing torch==2.13.0 (CPU)" >&2
    "$VENV/bin/pip" install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.version.cuda is not None)"; then
    echo "setup: the installed torch is a CUDA build ($("$VENV/bin/python" -c 'import torch; print(torch.__version__)')); rerun with TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu after removing $VENV" >&2
    exit 1
fi
STAMP="$VENV/.colibri-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    echo "setup: installing colibri-tune and test extras" >&2
    "$VENV/bin/pip" install -q -e ".[test,postgres]"
    touch "$STAMP"
fi

# llama.cpp's source tree for its GGUF converter (Python, no build): the GGUF round-trip tests
# (tests/test_gguf_llama_cpp.py) convert with it. The pinned tree scripts/build_llama_cpp.sh
# unpacks, into $LLAMA_CPP_DIR (default the user cache, where benchmarks/formats/gguf_roundtrip.py builds).
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-$HOME/.cache/colibri/llama.cpp}
if [ ! -f "$LLAMA_CPP_DIR/src/convert_hf_to_gguf.py" ]; then
    SOURCE_ONLY=1 PYTHON="$VENV/bin/python" scripts/build_llama_cpp.sh "$LLAMA_CPP_DIR" \
        || echo "setup: llama.cpp's source not fetched; the GGUF converter tests skip" >&2
fi
