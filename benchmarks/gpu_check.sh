#!/usr/bin/env bash
# Where a GPU is lent (one H100/H200): the CUDA tests, the main job on the GPU, and the bench,
# each under its own time limit so that one failure leaves the others' results. The log, the
# reports and the bench's JSON go to $OUT (default ./gpu-check). Needs torch with CUDA, pytest
# and transformers; runs from the source tree without installing. On the H200 of 2026-11-28,
# all but the last bench took 4.7 minutes; the limits below sum to under 11.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
log="$out/log.txt"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
zerodp=(python3 -m zerodp.apps.cli.main)  # an array: `timeout` runs no shell function
say() { echo "=== $* ($(date +%T))" | tee -a "$log"; }

say environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
python3 -c "import os, torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'cores', os.cpu_count())" 2>&1 | tee -a "$log"

say tests
timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/dist/test_cuda.py \
    tests/unit/test_streams.py 2>&1 | tail -60 | tee -a "$log"

for run in "3 none none" "2 cpu offload"; do
    set -- $run
    say "train stage $1 bf16 offload-optimizer $2 activation-checkpointing $3"
    timeout 60 "${zerodp[@]}" train --stage "$1" --precision bf16 --offload-optimizer "$2" \
        --activation-checkpointing "$3" --steps 30 --quiet --out "/tmp/train$1" 2>&1 |
        tail -40 | tee -a "$log"
    cp "/tmp/train$1/report.json" "$out/train$1.json" && cp "/tmp/train$1/report.png" "$out/train$1.png"
done

say bench
timeout 180 "${zerodp[@]}" bench --preset gpt1b --precision bf16 --world-size 1 --batch 4 --steps 5 \
    --warmup 2 --configs plain,zero2,zero3,zero2-offload,fsdp2 --quiet \
    --json "$out/gpu1b.json" 2>&1 | tee -a "$log"
say "bench, two ranks on one GPU over gloo (the multi-rank CUDA paths, not NCCL's speed)"
timeout 100 "${zerodp[@]}" bench --preset bench25m --precision bf16 --world-size 2 --backend gloo \
    --configs ddp,zero2,zero3 --steps 3 --warmup 1 --quiet >>"$log" 2>&1
say done
