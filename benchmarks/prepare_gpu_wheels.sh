#!/usr/bin/env bash
# Download the wheels the GPU suite needs into .whl/ (Python 3.12, manylinux x86_64: the GPU image), stamp the
# commit into .whl/COMMIT, optionally copy a length trace into .bench/, and check that everything that travels with
# a device call fits its 64 MiB limit.
#
#   benchmarks/prepare_gpu_wheels.sh [--trace TRACE.jsonl]
#
# The wheel rule: carry only what the GPU image lacks, and never replace a package it has. The image (python 3.12,
# torch 2.11, triton 3.6, transformers 5.17, accelerate 1.15, huggingface_hub 1.33, peft, pandas, pyarrow, xxhash,
# fsspec, psutil, jinja2, pytest on the last reading) lacks trl and datasets. gpu_suite.sh installs the wheels with
# benchmarks/install_wheels.py: --no-deps into /tmp/site, skipping every wheel whose distribution or modules the
# image already has, so nothing carried shadows an image package on PYTHONPATH. transformers is NOT carried: a 5.23
# wheel put in front of the image's 5.17 without its dependencies (it needs a newer huggingface_hub) could break
# every table, and the image's 5.17 runs the suite (checked on CPU with torch 2.11, triton 3.6, transformers 5.17:
# benchmarks/gpu_suite.sh OUT --part one --dry-run under that venv). Nor is pyarrow: datasets 5.2 asks for
# pyarrow >= 24; if the image's is older and datasets fails to import, the preflight says so (only grpo_step needs it).
#   trl 1.16.0           TRL's GRPOConfig / GRPOTrainer / pad (rollout_bench's TRL path, grpo_step)
#   datasets 5.2.0       imported by trl's trainers and by grpo_step (Dataset.from_dict)
#   dill, multiprocess   datasets' own dependencies that the image lacks
#   pytest 9.0.3,        the correctness parts (graphs on/off, kernels vs the torch reference); skipped at install
#   pluggy, iniconfig,   where the image has them (its list names pytest), carried for an image without
#   pygments
# Re-run before each GPU session: downloads are skipped when present, and .whl/COMMIT is refreshed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

TRACE=""
while [ $# -gt 0 ]; do
    case $1 in
        --trace) [ $# -ge 2 ] || { echo "usage: $0 [--trace TRACE.jsonl]" >&2; exit 2; }; TRACE=$2; shift 2 ;;
        *) echo "usage: $0 [--trace TRACE.jsonl]" >&2; exit 2 ;;
    esac
done

WHEELS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0
        pygments==2.20.0)
# never carried (the image has them; see the rule above): a wheel of one of these left in .whl/ is removed
NEVER=(torch triton transformers huggingface-hub numpy accelerate peft pyarrow tokenizers safetensors)

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
for f in .whl/*.whl; do  # the rule, checked on what is left (the list above could be edited by mistake)
    dist=$(basename "$f" | cut -d- -f1 | tr '_' '-' | tr 'A-Z' 'a-z')
    for n in "${NEVER[@]}"; do
        [ "$dist" != "$n" ] || { echo "$f: $n is in the GPU image and is never carried" >&2; exit 1; }
    done
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
