#!/usr/bin/env bash
# Builds the llama.cpp that benchmarks/peers/peers.py races against: the tree vendored by the
# llama-cpp-python source distribution on PyPI (a pinned release, so anyone gets the same
# sources), Release, GGML_NATIVE (this CPU's instruction set), CPU only.
#
#   scripts/build_llama_cpp.sh [DEST]        DEST defaults to $LLAMA_CPP_DIR or /work/tools/llama.cpp
#
# Result: DEST/src (the vendored tree, untouched), DEST/build/bin/{llama-simple,llama-bench,
# llama-tokenize,llama-perplexity}, DEST/BUILD_INFO (version, commit, flags) and DEST/READY once both binaries run.
# Nothing is written into this repository. Re-running skips the download and reuses the build
# directory (cmake rebuilds only what changed). Build jobs: $JOBS (default 2), at nice 19;
# BUILD_LOCK=FILE holds that flock for the compile step only.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DEST="${1:-${LLAMA_CPP_DIR:-/work/tools/llama.cpp}}"
JOBS="${JOBS:-2}"
PY="${PYTHON:-python3}"
# EXTRA_TARGETS="llama-quantize" adds binaries (benchmarks/formats/gguf_roundtrip.py needs llama-quantize).
# llama-perplexity: peers.py --quant's KL against bf16 (--kl-divergence).
# CPU_FLAGS replaces -DGGML_NATIVE=ON, e.g. a build without the AMX path (which segfaults on
# Q8_0/Q4_0 prompt processing on the Sapphire-Rapids-class Xeon here, docs/BENCHMARKS.md):
#   CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
#              -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
CPU_FLAGS="${CPU_FLAGS:--DGGML_NATIVE=ON}"
TARGETS=(llama-simple llama-bench llama-tokenize llama-perplexity ${EXTRA_TARGETS:-})

mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
if [ ! -f "$DEST/src/CMakeLists.txt" ]; then
    tmp="$(mktemp -d "$DEST/.download-XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    echo "peers: downloading llama-cpp-python==$VERSION (source distribution) from PyPI" >&2
    "$PY" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
    # The sdist carries the submodule's git metadata: note the llama.cpp commit, then drop the
    # dangling .git pointer so the build does not look for a repository that is not there.
    git -C "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" rev-parse HEAD > "$tmp/SOURCE_COMMIT" 2>/dev/null \
        || echo unknown > "$tmp/SOURCE_COMMIT"
    rm -f "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/.git"
    rm -rf "$DEST/src"
    mv "$tmp/SOURCE_COMMIT" "$DEST/SOURCE_COMMIT"
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST/src"   # rename: no half-extracted tree
fi
# SOURCE_ONLY=1: the tree only (its Python GGUF converter needs no build; scripts/setup.sh).
[ -n "${SOURCE_ONLY:-}" ] && { echo "peers: llama.cpp source in $DEST/src (not built)" >&2; exit 0; }

echo "peers: configuring (Release, $CPU_FLAGS, CPU only)" >&2
# shellcheck disable=SC2086  # CPU_FLAGS is a list of words
cmake -S "$DEST/src" -B "$DEST/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release $CPU_FLAGS -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON >/dev/null

echo "peers: building ${TARGETS[*]} with $JOBS jobs (long on a small machine)" >&2
# On a shared box, BUILD_LOCK=/path serialises the build with other heavy work (flock).
lock=()
[ -n "${BUILD_LOCK:-}" ] && lock=(flock "$BUILD_LOCK")
nice -n 19 "${lock[@]}" cmake --build "$DEST/build" --target "${TARGETS[@]}" -j "$JOBS"

for t in llama-simple llama-bench llama-perplexity; do
    "$DEST/build/bin/$t" --help >/dev/null 2>&1 || [ $? -le 1 ] || { echo "peers: $t does not run" >&2; exit 1; }
done
{
    echo "llama_cpp_python_version=$VERSION"
    echo "llama_cpp_commit=$(cat "$DEST/SOURCE_COMMIT" 2>/dev/null || echo unknown)"
    echo "cmake_flags=Release $CPU_FLAGS BUILD_SHARED_LIBS=OFF CPU"
    echo "compiler=$(c++ --version | head -1)"
    echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$DEST/BUILD_INFO.tmp"
mv "$DEST/BUILD_INFO.tmp" "$DEST/BUILD_INFO"
touch "$DEST/READY"
echo "peers: llama.cpp ready in $DEST/build/bin" >&2
