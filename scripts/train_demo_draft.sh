#!/usr/bin/env bash
# Train the shipped draft for SmolLM2-135M-Instruct (hfspec/drafts/smollm2-135m-instruct-draft)
# on a 2-core CPU. Everything lands under runs/ (gitignored); every step resumes when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1  # one thread per process: two processes share the two cores better
COMMON="--target offline --tokens 400000 --eval-tokens 12000 --seq-len 128 --gen-batch 32 --top-k 32"

# 1. Stage target-generated data with two processes sharing runs/demo/data.
mkdir -p runs/demo
nice -n 10 python -m hfspec.distill $COMMON --out runs/demo --data-only --quiet &
nice -n 10 python -m hfspec.distill $COMMON --out runs/demo --data-only --quiet
wait

# 2. Train the draft on that data (the shipped configuration).
mkdir -p runs/final && ln -sfn ../demo/data runs/final/data
nice -n 10 python -m hfspec.distill $COMMON --out runs/final \
  --hidden 128 --layers 2 --heads 4 --batch 16 --steps 2400 --lr 8e-3

# 3. Copy the draft (fp16 weights, tokenizer, report) into the package.
DEST=hfspec/drafts/smollm2-135m-instruct-draft
mkdir -p "$DEST"
cp runs/final/{config.json,generation_config.json,model.safetensors,tokenizer.json,tokenizer_config.json,chat_template.jinja,distill_report.json} "$DEST"/
