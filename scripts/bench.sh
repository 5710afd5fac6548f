#!/usr/bin/env bash
# The measured runs behind docs/benchmarks.md: SmolLM2-135M-Instruct (built offline) as the target,
# on the CPU, with every drafter hfspec ships. Run it on an otherwise idle machine: a second busy
# process on the same cores makes torch's threads wait at every barrier and the ratios meaningless.
# On an idle 2-core machine it takes about 80 minutes; `scripts/bench.sh main` (or eagle, grounded, open, mixed)
# runs one part. Extra arguments after the part go to every `hfspec bench` call.
# hfspec's contenders run the CPU linear kernel (hfspec.fast) and transformers' run torch's own linears; each
# table gives the target step and v(γ) both ways, and speed-ups against plain generate() (×plain) and against
# hfspec at γ = 0 on the same kernels (×γ0). Pass --no-fast-kernels after the part for torch's linears throughout.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${BENCH_OUT:-runs/bench}"
part="${1:-all}"
[ $# -gt 0 ] && shift
mkdir -p "$out"
eagle="hfspec/data/drafts/smollm2-135m-instruct-eagle3"
common=(--target offline --draft shipped --threads 2 --warmup 1 --batch-size 0)

run() {  # run NAME ARGS...: one bench run, its table in $out/NAME.txt and its results in $out/NAME.json
    local name=$1
    shift
    echo "== $name ($(date -u +%H:%M) UTC)"
    local start=$SECONDS
    hfspec bench "${common[@]}" "$@" --json "$out/$name.json" | tee "$out/$name.txt"
    echo "$name took $(( (SECONDS - start) / 60 )) min" | tee -a "$out/$name.txt"
}

drafters=useless
[ -d "$eagle" ] && drafters="useless,shipped-eagle3"

# 1. Default settings against fixed γ, plain generate(), transformers' assisted generation (its defaults and
#    at the same γ), a useless draft (random weights of the draft's shape) and the shipped EAGLE-3 head;
#    greedy and T = 0.7, top-p 0.95, on the open-ended chat prompts.
if [[ $part == all || $part == main ]]; then
    run main --num-prompts 12 --max-new-tokens 48 --gamma 2 --gammas 1,2,3,4 --drafters "$drafters" \
        --plot docs/bench-smollm2-cpu.png "$@"
fi
# 1b. The EAGLE-3 head as the main drafter: fixed γ beside its defaults, for its acceptance and tokens per pass
#     on the same prompts (transformers cannot run a head, so there is no assisted contender).
if [[ ( $part == all || $part == eagle ) && -d $eagle ]]; then
    run eagle --draft shipped-eagle3 --num-prompts 12 --max-new-tokens 48 --modes greedy --gamma 3 --gammas 1,2,3,5 \
        --skip hfspec-heuristic,hfspec-cost "$@"
fi
# 2. Drafting by lookup on input-grounded prompts (summaries, rewrites, code edits, answers from a passage):
#    n-gram and the hybrid against transformers' prompt lookup, greedy.
if [[ $part == all || $part == grounded ]]; then
    run grounded --prompts-file hfspec/data/prompts/grounded.jsonl --num-prompts 16 --max-new-tokens 64 --modes greedy \
        --gamma 3 --gammas 3 --drafters ngram,hybrid --skip assisted,hfspec,hfspec-heuristic,hfspec-cost "$@"
fi
# 3. The same drafters on the open-ended prompts, where lookup finds little: gamma="auto" must fall back.
if [[ $part == all || $part == open ]]; then
    run open --num-prompts 12 --max-new-tokens 48 --modes greedy \
        --gamma 3 --gammas 3 --drafters ngram,hybrid --skip assisted,hfspec,hfspec-heuristic,hfspec-cost "$@"
fi
# 4. Half open-ended, half grounded: the hybrid against each of its parts.
if [[ $part == all || $part == mixed ]]; then
    run mixed --prompts-file hfspec/data/prompts/mixed.jsonl --num-prompts 16 --max-new-tokens 48 --modes greedy \
        --gamma 3 --gammas 3 --drafters ngram,hybrid --skip assisted,hfspec,hfspec-heuristic,hfspec-cost "$@"
fi
