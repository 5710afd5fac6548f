#!/usr/bin/env bash
# Train the shipped draft for SmolLM2-135M-Instruct (hfspec/data/drafts/smollm2-135m-instruct-draft)
# on a 2-core CPU. Everything lands under runs/ (gitignored); every step resumes when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1  # one thread per process: two processes share the two cores better
COMMON="--target offline --tokens 400000 --eval-tokens 12000 --seq-len 128 --gen-batch 32 --top-k 32"

ARCH="--hidden 128 --layers 2 --heads 4 --batch 16"

# 1. Stage 400k target-generated tokens with two processes sharing runs/demo/data.
mkdir -p runs/demo
nice -n 10 python -m hfspec.training $COMMON --out runs/demo --data-only --quiet &
nice -n 10 python -m hfspec.training $COMMON --out runs/demo --data-only --quiet
wait

# 2. Train a first draft on that data.
mkdir -p runs/final && ln -sfn ../demo/data runs/final/data
nice -n 10 python -m hfspec.training $COMMON --out runs/final $ARCH --steps 2400 --lr 8e-3

# 3. Stage more data, up to about 900k tokens, two processes again.
nice -n 10 python -m hfspec.training ${COMMON/--tokens 400000/--tokens 900000} --out runs/demo --data-only --quiet &
nice -n 10 python -m hfspec.training ${COMMON/--tokens 400000/--tokens 900000} --out runs/demo --data-only --quiet
wait

# 4. Go on from the first draft on all the data; the best held-out check (every 200 steps) is kept.
mkdir -p runs/stageB1 && ln -sfn ../demo/data runs/stageB1/data
nice -n 5 python -m hfspec.training $COMMON --out runs/stageB1 $ARCH --steps 3600 --lr 5e-3 --init-from runs/final

# 5. Copy the draft (fp16 weights, tokenizer, report) into the package.
DEST=hfspec/data/drafts/smollm2-135m-instruct-draft
mkdir -p "$DEST"
cp runs/stageB1/{config.json,generation_config.json,model.safetensors,tokenizer.json,tokenizer_config.json,chat_template.jinja,distill_report.json} "$DEST"/
