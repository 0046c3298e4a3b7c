#!/usr/bin/env bash
# Build llama.cpp's `llama-bench` and `llama-server` from source on this machine, for the
# side-by-side comparison (python -m benchmarks.vs_llama_cpp). Never shipped with servelab.
#
# The source is the llama.cpp tree vendored in llama-cpp-python's source distribution on PyPI
# (a package registry is all this machine can reach). Native CPU flags, no curl, CPU backend only.
# Prints the directory holding the two binaries. About 10 minutes on 2 cores; reruns are instant.
# The build is native, so it is kept per CPU (a folder named by a hash of the CPU's flags): a
# build from another machine kind dies here on an instruction this CPU lacks.
#
#   bash benchmarks/llama_cpp_build.sh            # -> ~/.cache/servelab/llama.cpp/build-<cpu>/bin
#   LLAMA_CPP_DIR=/somewhere bash benchmarks/llama_cpp_build.sh
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DEST="${LLAMA_CPP_DIR:-$HOME/.cache/servelab/llama.cpp}"
mkdir -p "$DEST"
cd "$DEST"

if [ ! -f src/CMakeLists.txt ]; then
  python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d sdist >&2
  tar xzf "sdist/llama_cpp_python-$VERSION.tar.gz"
  rm -rf src
  mv "llama_cpp_python-$VERSION/vendor/llama.cpp" src
  rm -rf "llama_cpp_python-$VERSION"
fi

CPU="$( (grep -m1 -E '^(flags|Features)' /proc/cpuinfo || uname -m) | sha1sum | cut -c1-10)"
BUILD="build-$CPU"
# ggml's AMX path (Q4_1 on the tiles) dies on a 2-core AMX Xeon VM with SIGILL at its first
# `tilezero` (2026-12-03, llama.cpp from llama-cpp-python 0.3.36): there it is built without AMX,
# and multiplies on AVX512-VNNI as on any other AVX-512 CPU. Explicit -mno-* flags outrank -march.
NO_AMX=()
if grep -qw amx_tile /proc/cpuinfo && [ -z "${LLAMA_CPP_AMX:-}" ]; then
  FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  NO_AMX=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "-DCMAKE_C_FLAGS=$FLAGS" "-DCMAKE_CXX_FLAGS=$FLAGS")
fi
if [ ! -x "$BUILD/bin/llama-bench" ] || [ ! -x "$BUILD/bin/llama-server" ]; then
  cmake -S src -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${NO_AMX[@]}" >&2
  cmake --build "$BUILD" -j "$(nproc)" --target llama-bench llama-server >&2
fi
echo "$DEST/$BUILD/bin"
