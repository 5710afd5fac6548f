#!/usr/bin/env bash
# The measured run behind docs/BENCHMARKS.md: SmolLM2-135M-Instruct (built offline) as the
# target, the draft shipped in the package, on CPU. On an otherwise idle 2-core machine it
# takes about 15 minutes; on cores shared with other jobs pass --threads 1.
# Extra arguments go to `hfspec bench` (e.g. --draft PATH, --num-prompts 4).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${BENCH_OUT:-runs/bench}"
mkdir -p "$out"
hfspec bench --target offline --draft shipped \
    --num-prompts 12 --max-new-tokens 48 --gamma 2 --gammas 1,2,3,4 \
    --warmup 1 --batch-size 0 --threads 2 \
    --json "$out/bench.json" --plot docs/bench-smollm2-cpu.png "$@" | tee "$out/bench.txt"
