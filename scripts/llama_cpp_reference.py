"""The llama.cpp reference line: greedy decoding of given token ids with llama-cpp-python, on the same GGUF.

Not a dependency of hfspec: run it with an interpreter that has llama-cpp-python (e.g. /work/llamavenv/bin/python).
It reads a JSON list of prompts as token ids (the caller's tokenizer and chat template, so that both sides decode
exactly the same prompt), decodes ``--new`` tokens greedily after each (end-of-sequence tokens do not stop it), and
prints JSON: per prompt the prompt-processing seconds (the prompt and the first token), the seconds of the other
new tokens, tokens per second without and with prompt processing, and the tokens. With ``-`` as the prompts file
it serves: one JSON list of ids per line on stdin, one result per line on stdout (scripts/gguf_pair_bench.py runs
it so, to interleave it with hfspec prompt by prompt).

    python scripts/llama_cpp_reference.py MODEL.gguf PROMPTS.json --new 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from llama_cpp import Llama


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("prompts", help="JSON file: a list of token-id lists; '-': serve lines of ids on stdin")
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt (default: 64)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes over the first prompt (default: 1)")
    args = parser.parse_args()
    llm = Llama(
        model_path=args.model,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=4096,
        n_batch=512,
        seed=0,
        verbose=False,
    )

    def decode(ids: list[int]) -> tuple[float, float, list[int]]:
        llm.reset()
        out = []
        start = time.perf_counter()
        first = None
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if first is None:
                first = time.perf_counter()
            if len(out) == args.new:
                break
        end = time.perf_counter()
        return first - start, end - first, out

    def result(ids: list[int]) -> dict:
        prompt_s, rest_s, tokens = decode(ids)
        return {
            "prompt_tokens": len(ids),
            "prompt_s": prompt_s,
            "decode_s": rest_s,
            "tok_s": (len(tokens) - 1) / rest_s,
            "tok_s_with_prompt": len(tokens) / (prompt_s + rest_s),
            "tokens": tokens,
        }

    if args.prompts == "-":
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(result(json.loads(line))), flush=True)
        return 0
    with open(args.prompts) as f:
        prompts = json.load(f)
    for _ in range(args.warmup):
        decode(prompts[0])
    results = [result(ids) for ids in prompts]
    json.dump(
        {"llama_cpp": __import__("llama_cpp").__version__, "threads": args.threads, "results": results}, sys.stdout
    )
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
