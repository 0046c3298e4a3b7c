#!/usr/bin/env bash
# Run HERE (the CPU machine) before the GPU check: fetch the wheels the GPU image lacks into .whl/
# and write the embedded model's tokenizer, without its weights, to .gpu/tokenizer/ (the GGUF is
# too big to carry). Both folders are git-ignored and travel with the device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in /.whl/ /.gpu/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
rm -rf .whl .gpu && mkdir -p .whl .gpu
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl hydra-core==1.3.2 omegaconf==2.3.0
python -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
python -c "from core.model.default_model import default_model_path as p; from core.model.loader import load_tokenizer as t; t(p()).save('.gpu/tokenizer')"
du -sh .whl .gpu
