#!/usr/bin/env bash
# The measured run behind docs/BENCHMARKS.md: SmolLM2-135M-Instruct (built offline) as the
# target, the draft shipped in the package, on CPU. About 12 minutes on 2 cores.
# Extra arguments go to `hfspec bench` (e.g. --draft PATH, --num-prompts 4).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${BENCH_OUT:-runs/bench}"
mkdir -p "$out"
hfspec bench --target offline --draft shipped \
    --num-prompts 12 --max-new-tokens 64 --gamma 4 --gammas 1,2,3,4,6,8 \
    --warmup 2 --batch-size 8 --batch-repeats 2 --threads 2 \
    --json "$out/bench.json" --plot docs/bench-smollm2-cpu.png "$@" | tee "$out/bench.txt"
