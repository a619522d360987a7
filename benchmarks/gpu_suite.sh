#!/usr/bin/env bash
# Every GPU table of issue 14 in three parts, on a fresh GPU machine with no network.
#
#   benchmarks/gpu_suite.sh OUTDIR [--part 1|2|3|all] [--dry-run] [--plan]
#
# Run from anywhere; works in the repository root. Installs the wheels in .whl/ (prepare them with
# benchmarks/prepare_gpu_wheels.sh) into /tmp/site, prints versions and nvidia-smi, then runs the part's tables, each
# under its own time limit, writing OUTDIR/NAME.json + OUTDIR/NAME.md per table and OUTDIR/partN.log (everything
# printed). A table that fails or runs out of time is reported in the summary and the next one still runs; its JSON
# keeps the rows measured so far.
#
#   part 1: kernels vs the torch reference (pytest on CUDA), decode step time vs the roofline, attention microbench
#   part 2: throughput, G=32, 1 and 8 prompts: TRL generate, TRL + continuous batching, engine (graphs on / off)
#   part 3: peak memory at G = 8, 32, 128 (full_group vs fixed_slot), speculative decoding, one GRPO trainer step
#
# --dry-run: the same commands at toy sizes on the CPU (tiny models, a few tokens; pytest only collects), so that a
#            typo fails here and not on the GPU. --plan: print the commands ("PLAN <part> <command>" lines), run none.
# Lengths: a GSM8K length trace if .bench/gsm8k_trace.jsonl exists (carry .bench), else log-normal (mean 256,
# sigma 0.6), clipped to 1024 new tokens; the same prompts and lengths on every path.
# Estimated GPU time (H100; see benchmarks/README.md "GPU suite"): part 1 ~3 min, part 2 ~3.5 min, part 3 ~4 min.
set -uo pipefail

usage() { echo "usage: $0 OUTDIR [--part 1|2|3|all] [--dry-run] [--plan]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; shift
PART=all; DRY=0; PLAN=0
while [ $# -gt 0 ]; do
    case $1 in
        --part) [ $# -ge 2 ] || usage; PART=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --plan) PLAN=1; shift ;;
        *) usage ;;
    esac
done
case $PART in 1|2|3|all) ;; *) usage ;; esac
case $OUT in -*) usage ;; esac

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# ------------------------------------------------------------------------------------------------------- sizes
TRACE=.bench/gsm8k_trace.jsonl
if [ $DRY = 0 ]; then
    MODEL=qwen3-1.7b; MAXNEW=1024; PROMPT=128; G=32; SLOTS=32; MANY=8
    LENGTHS=(--mean 256 --sigma 0.6)
    KV_THROUGHPUT=12; KV_MEMORY=20; MEMORY_G=(8 32 128); CB=()
    STEP_ARGS=(--active 32 128 --prompt-len 128 1024 --new-tokens 128 --eager-active 32 128 --kv-cache-gb 24)
    ATTN_ARGS=(--iters 50)
    SPEC_ARGS=(--kv-cache-tokens 40000)
    PYTEST_ARGS=(--durations=15)
    LIMITS=(240 180 90 240 300 150 200 200)
else
    MODEL=tiny; MAXNEW=16; PROMPT=8; G=4; SLOTS=4; MANY=2
    LENGTHS=(--mean 8 --sigma 0.6)
    KV_THROUGHPUT=0.01; KV_MEMORY=0.01; MEMORY_G=(2 4 8); CB=(--cb-memory-percent 0.05)
    STEP_ARGS=(--active 2 4 --prompt-len 8 16 --new-tokens 6 --eager-active 2 --kv-cache-gb 0.01)
    ATTN_ARGS=(--num-prompts 1 --group-size 2 --prompt-len 16 --own-len 8 --heads 4 --kv-heads 2 --head-dim 16
               --block-size 4 --iters 1)
    SPEC_ARGS=(--kv-cache-tokens 2000)
    PYTEST_ARGS=(--collect-only)
    LIMITS=(300 300 300 300 300 300 300 300)
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
fi
[ -f "$TRACE" ] && LENGTHS=(--trace "$TRACE")

# ------------------------------------------------------------------------------------------------------- runner
SUMMARY=()
bench() {  # bench NAME LIMIT_S COMMAND...: run with a time limit, log, keep going on failure
    local name=$1 limit=$2; shift 2
    if [ $PLAN = 1 ]; then printf 'PLAN %s' "$CURRENT"; printf ' %q' "$@"; printf '\n'; return 0; fi
    echo; echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 15 "$limit" "$@"
    local rc=$?
    local status=ok
    [ $rc = 0 ] || status="FAILED rc=$rc"
    [ $rc = 124 ] && status="TIMED OUT after ${limit}s"
    SUMMARY+=("$(printf '%-16s %-28s %4ss' "$name" "$status" $((SECONDS - t0)))")
}

setup() {
    PART_START=$SECONDS
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/part$1.log") 2>&1
    echo "gpu_suite part $1 $( [ $DRY = 1 ] && echo '(dry run, CPU, toy sizes)' ) $(date -u '+%Y-%m-%d %H:%M UTC')"
    if [ $DRY = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
        if [ ! -f /tmp/site/.installed ] || ! cmp -s <(ls .whl/*.whl) /tmp/site/.installed; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                .whl/*.whl || { echo "wheel install failed"; exit 1; }
            ls .whl/*.whl > /tmp/site/.installed
        fi
        export PYTHONPATH=/tmp/site:$ROOT
    else
        export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    fi
    [ -f .whl/COMMIT ] && echo "commit (from .whl/COMMIT): $(cat .whl/COMMIT)"
    "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
for name in ("triton", "transformers", "trl", "datasets", "accelerate", "peft", "pyarrow", "fsspec", "numpy"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')} ({module.__file__})")
    except Exception as e:  # report and go on: the tables that need it fail on their own
        print(f"{name}: NOT IMPORTABLE ({type(e).__name__}: {e})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi
}

finish() {
    echo; echo "=== summary of part $1 ($((SECONDS - PART_START)) s in all)"
    printf '%s\n' "${SUMMARY[@]}"
    ls -la "$OUT"
}

# -------------------------------------------------------------------------------------------------------- parts
part1() {
    local xdist=()
    [ $DRY = 0 ] && "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 8)
    bench kernels "${LIMITS[0]}" "$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" "${PYTEST_ARGS[@]}" \
        tests/engine/test_triton_attention.py tests/engine/test_static_decode.py
    bench decode_step "${LIMITS[1]}" "$PY" benchmarks/decode_step.py --model "$MODEL" "${STEP_ARGS[@]}" \
        --json "$OUT/decode_step.json"
    bench attention "${LIMITS[2]}" "$PY" benchmarks/attention_bench.py "${ATTN_ARGS[@]}" --json "$OUT/attention.json"
}

part2() {
    local common=(--model "$MODEL" --group-sizes "$G" --max-new-tokens "$MAXNEW" --prompt-len "$PROMPT"
                  "${LENGTHS[@]}" --slots "$SLOTS" --schedulers fifo --kv-cache-gb "$KV_THROUGHPUT" "${CB[@]}")
    bench throughput_1x32 "${LIMITS[3]}" "$PY" benchmarks/rollout_bench.py "${common[@]}" --num-prompts 1 \
        --modes fixed_slot dynamic_slot --eager-modes fixed_slot --json "$OUT/throughput_1x32.json"
    bench throughput_8x32 "${LIMITS[4]}" "$PY" benchmarks/rollout_bench.py "${common[@]}" --num-prompts "$MANY" \
        --modes fixed_slot dynamic_slot --json "$OUT/throughput_8x32.json"
}

part3() {
    bench memory "${LIMITS[5]}" "$PY" benchmarks/rollout_bench.py --model "$MODEL" --num-prompts 1 \
        --group-sizes "${MEMORY_G[@]}" --max-new-tokens "$MAXNEW" --prompt-len "$PROMPT" "${LENGTHS[@]}" \
        --slots "$SLOTS" --paths engine --modes full_group fixed_slot --schedulers fifo --kv-cache-gb "$KV_MEMORY" \
        --json "$OUT/memory.json"
    bench speculative "${LIMITS[6]}" "$PY" benchmarks/speculative.py --model "$MODEL" --num-prompts 1 \
        --group-sizes "$G" --temperatures 1 0 --methods none ngram suffix --adaptive on --eager-none \
        --max-new-tokens "$MAXNEW" --prompt-len "$PROMPT" "${LENGTHS[@]}" "${SPEC_ARGS[@]}" \
        --json "$OUT/speculative.json"
    bench grpo_step "${LIMITS[7]}" "$PY" benchmarks/grpo_step.py --model "$MODEL" --sizes "${G}x1@$MAXNEW" \
        --prompt-len "$PROMPT" --lengths forced "${LENGTHS[@]}" "${CB[@]}" --steps 2 --json "$OUT/grpo_step.json"
}

for p in 1 2 3; do
    [ "$PART" = all ] || [ "$PART" = $p ] || continue
    CURRENT=$p
    if [ $PLAN = 1 ]; then "part$p"; continue; fi
    ( setup $p; "part$p"; finish $p )
done
