#!/usr/bin/env bash
# Download the wheels the GPU suite needs into .whl/ (Python 3.12, manylinux x86_64: the GPU image), stamp the
# commit into .whl/COMMIT, optionally copy a length trace into .bench/, and check that everything that travels with
# a device call fits its 64 MiB limit.
#
#   benchmarks/prepare_gpu_wheels.sh [--trace TRACE.jsonl] [--with-pyarrow]
#
# Why each wheel (the GPU image has torch 2.11, triton 3.6, transformers 5.17, accelerate 1.15, peft, pandas,
# pyarrow, xxhash, fsspec, psutil, jinja2, but not trl or datasets):
#   trl 1.16.0           TRL's GRPOConfig / GRPOTrainer / pad (rollout_bench's TRL paths, grpo_step)
#   datasets 5.2.0       imported by trl's trainers and by grpo_step (Dataset.from_dict)
#   dill, multiprocess   datasets' own dependencies that the image lacks
#   transformers 5.23.0  the version CI and every CPU test run on. The image's 5.17 also runs the suite's paths
#                        (checked on CPU: the greedy, static-decode, step-hook and trainer tests pass and the three
#                        rollout paths run), but 2 model-support tests differ there (gemma2 soft-capping, hy_v4)
# --with-pyarrow adds pyarrow 26.0.1 (55 MB) for an image whose pyarrow is older than datasets 5.2 needs (>= 24):
# it fits 64 MiB only without transformers 5.23, so it drops that wheel (the suite then runs on the image's 5.17).
# Re-run before each GPU session: downloads are skipped when present, and .whl/COMMIT is refreshed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

TRACE=""; PYARROW=0
while [ $# -gt 0 ]; do
    case $1 in
        --trace) TRACE=$2; shift 2 ;;
        --with-pyarrow) PYARROW=1; shift ;;
        *) echo "usage: $0 [--trace TRACE.jsonl] [--with-pyarrow]" >&2; exit 2 ;;
    esac
done

WHEELS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
if [ $PYARROW = 1 ]; then WHEELS+=(pyarrow==26.0.1); rm -f .whl/transformers-*.whl
else WHEELS+=(transformers==5.23.0); rm -f .whl/pyarrow-*.whl; fi

git check-ignore -q .whl/x.whl || { echo ".whl/ is not ignored by git: add /.whl/ to .gitignore" >&2; exit 1; }
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"

# one version per package (two stop the whole install): drop wheels not asked for
for f in .whl/*.whl; do
    name=$(basename "$f" | cut -d- -f1,2 | tr '_' '-' | tr 'A-Z' 'a-z')
    keep=0
    for w in "${WHEELS[@]}"; do [ "${w/==/-}" = "$name" ] && keep=1; done
    [ $keep = 1 ] || { echo "removing $f (not in the list)"; rm -f "$f"; }
done

dirty=$(git status --porcelain --untracked-files=no | head -c1)
echo "$(git rev-parse --short HEAD)${dirty:++dirty}" > .whl/COMMIT

if [ -n "$TRACE" ]; then
    git check-ignore -q .bench/x || { echo ".bench/ is not ignored by git: add /.bench/ to .gitignore" >&2; exit 1; }
    mkdir -p .bench && cp "$TRACE" .bench/gsm8k_trace.jsonl
fi

# what travels: tracked + untracked-not-ignored files, plus the carried folders
tree=$(git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
carried=$(du -sb .whl $( [ -d .bench ] && echo .bench ) | awk '{s+=$1} END {print s+0}')
ls -l .whl
echo "commit stamp: $(cat .whl/COMMIT)"
awk -v t="$tree" -v c="$carried" -v b="$( [ -d .bench ] && echo ', .bench' )" 'BEGIN {
    printf "working tree %.1f MiB + carried (.whl%s) %.1f MiB = %.1f MiB of 64 MiB\n", t / 2^20, b, c / 2^20,
        (t + c) / 2^20;
    exit (t + c > 64 * 2^20) }' || { echo "over the 64 MiB a device call carries" >&2; exit 1; }
