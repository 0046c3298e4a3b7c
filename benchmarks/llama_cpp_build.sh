#!/usr/bin/env bash
# Build llama.cpp's `llama-bench` and `llama-server` from source on this machine, for the
# side-by-side comparison (python -m benchmarks.vs_llama_cpp). Never shipped with servelab.
#
# The source is the llama.cpp tree vendored in llama-cpp-python's source distribution on PyPI
# (a package registry is all this machine can reach). Native CPU flags, no curl, CPU backend only.
# Prints the directory holding the two binaries. About 10 minutes on 2 cores; reruns are instant.
#
#   bash benchmarks/llama_cpp_build.sh            # -> ~/.cache/servelab/llama.cpp/build/bin
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

if [ ! -x build/bin/llama-bench ] || [ ! -x build/bin/llama-server ]; then
  cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
  cmake --build build -j "$(nproc)" --target llama-bench llama-server >&2
fi
echo "$DEST/build/bin"
