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
# torch first and pinned: this exact version is the CPU wheel; letting another package pull
# an unpinned torch would download a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    echo "setup: installing torch==2.13.0 (CPU)" >&2
    "$VENV/bin/pip" install -q torch==2.13.0
fi
STAMP="$VENV/.colibri-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    echo "setup: installing colibri-tune and test extras" >&2
    "$VENV/bin/pip" install -q -e ".[test,postgres]"
    touch "$STAMP"
fi
