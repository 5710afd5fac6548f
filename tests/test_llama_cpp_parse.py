"""llama.cpp's printed output, parsed (hfspec.bench.llama_cpp), from captured text: no binary needed."""

from __future__ import annotations

import json

import pytest

from hfspec.bench import llama_cpp

BENCH_JSON = json.dumps(
    [
        {"model_filename": "t.gguf", "n_threads": 2, "n_prompt": k, "n_gen": 0, "n_depth": 256, "avg_ts": s,
         "stddev_ts": 0.5, "samples_ts": [s]}
        for k, s in ((1, 31.9), (2, 46.1), (4, 57.0), (8, 69.0), (16, 113.9))
    ]
    + [{"n_prompt": 0, "n_gen": 32, "n_depth": 256, "avg_ts": 31.1, "stddev_ts": 0.2}]
)  # fmt: skip

BENCH_MARKDOWN = """\
| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| qwen2 1.5B Q4_K - Medium       |   1.04 GiB |     1.54 B | CPU        |       2 |      pp1 @ d256 |         31.90 ± 0.50 |
| qwen2 1.5B Q4_K - Medium       |   1.04 GiB |     1.54 B | CPU        |       2 |      pp2 @ d256 |         46.10 ± 0.50 |
| qwen2 1.5B Q4_K - Medium       |   1.04 GiB |     1.54 B | CPU        |       2 |     tg32 @ d256 |         31.10 ± 0.20 |
| qwen2 1.5B Q4_K - Medium       |   1.04 GiB |     1.54 B | CPU        |       2 |           tg16 |         33.00 |

build: 0c1e570 (1)
"""

PROMPT = "<|im_start|>user\nWrite a haiku.<|im_end|>\n<|im_start|>assistant\n"
SPEC_STDOUT = "\n\n" + PROMPT + "Waves fold into foam\nsalt on the wind\n\n"
# As llama.cpp 0c1e570 prints them (log lines carry a timestamp and a level letter).
SPEC_STDERR = """\
0.03.574.605 W load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the model.
1.30.107.762 I encoded   24 tokens in    0.512 seconds, speed:   46.875 t/s
1.30.107.783 I decoded   98 tokens in    5.880 seconds, speed:   16.667 t/s
1.30.107.802 I n_draft   = 3
1.30.107.812 I n_predict = 98
1.30.107.822 I n_drafted = 120
1.30.107.831 I n_accept  = 106
1.30.107.841 I accept    = 88.333%
1.30.107.991 I common_perf_print: prompt eval time =   4677.76 ms /    38 tokens ( 123.09 ms per token)
"""


def test_bench_json_and_markdown_agree_on_the_rows() -> None:
    rows = llama_cpp.parse_bench(BENCH_JSON)
    assert [r.name for r in rows] == [f"pp{k} @ d256" for k in (1, 2, 4, 8, 16)] + ["tg32 @ d256"]
    assert rows[-1] == llama_cpp.BenchRow(0, 32, 256, 31.1, 0.2)
    md = llama_cpp.parse_bench(BENCH_MARKDOWN)
    assert [r.name for r in md] == ["pp1 @ d256", "pp2 @ d256", "tg32 @ d256", "tg16"]
    assert md[1] == llama_cpp.BenchRow(2, 0, 256, 46.1, 0.5)
    assert md[3] == llama_cpp.BenchRow(0, 16, 0, 33.0, 0.0)  # no depth, no ± part


def test_bench_rejects_text_without_a_table() -> None:
    with pytest.raises(ValueError, match="no llama-bench table"):
        llama_cpp.parse_bench("error: failed to load model\n")
    with pytest.raises(ValueError, match="unexpected llama-bench row"):
        llama_cpp.parse_bench(BENCH_MARKDOWN.replace("pp2 @ d256", "xx2 @ d256"))


def test_verification_costs_are_k_times_pp1_over_ppk() -> None:
    costs = llama_cpp.verification_costs(llama_cpp.parse_bench(BENCH_JSON), 256)
    assert costs["tg"] == 31.1 and costs["pp"][16] == 113.9
    assert [round(costs["v"][k], 2) for k in (1, 2, 4, 8, 16)] == [1.0, 1.38, 2.24, 3.7, 4.48]
    assert costs["v_tg"][2] == pytest.approx(2 * 31.1 / 46.1)
    assert llama_cpp.verification_costs(llama_cpp.parse_bench(BENCH_JSON), 0)["v"] is None  # no rows there


def test_speculative_stats_and_text() -> None:
    run = llama_cpp.parse_speculative(SPEC_STDOUT, SPEC_STDERR, PROMPT)
    assert (run.prompt_tokens, run.new_tokens, run.n_max, run.drafted, run.accepted) == (24, 98, 3, 120, 106)
    assert run.text == "Waves fold into foam\nsalt on the wind"
    assert run.decode_tok_s == pytest.approx(98 / 5.88)
    assert run.end_to_end_tok_s == pytest.approx(98 / (0.512 + 5.88))
    assert run.acceptance == pytest.approx(106 / 120)


def test_speculative_reads_log_lines_without_prefixes_and_reports_what_is_missing() -> None:
    bare = "\n".join(line.split(" ", 2)[2] for line in SPEC_STDERR.splitlines())  # --no-log-prefix
    assert llama_cpp.parse_speculative(SPEC_STDOUT, bare, PROMPT).accepted == 106
    with pytest.raises(ValueError, match="printed no line matching"):
        llama_cpp.parse_speculative(SPEC_STDOUT, "failed to initialize speculative decoding\n", PROMPT)


def test_commands_name_the_2026_options() -> None:
    spec = llama_cpp.speculative_command("bin/s", "t.gguf", "d.gguf", "hi", threads=2, new=96, n_max=4)
    assert spec[spec.index("--spec-type") + 1] == "draft-simple" and spec[spec.index("--spec-draft-n-max") + 1] == "4"
    assert "--draft-max" not in spec
    plain = llama_cpp.server_command("bin/llama-server", "t.gguf", port=8080, threads=2, slots=16, slot_context=512)
    assert plain[plain.index("-np") + 1] == "16" and plain[plain.index("-c") + 1] == str(16 * 512)
    assert "-md" not in plain and plain[plain.index("--host") + 1] == "127.0.0.1"
    draft = llama_cpp.server_command("s", "t.gguf", port=1, threads=2, slots=1, draft="d.gguf")
    assert draft[draft.index("-md") + 1] == "d.gguf" and "--spec-draft-n-max" not in draft


def test_a_tool_killed_by_a_signal_is_told_to_build_a_portable_one():
    crashed = llama_cpp.tool_failed("llama-bench", -11, "stderr text")
    assert "signal 11" in crashed and "build_llama_cpp.py --portable" in crashed and crashed.endswith("stderr text")
    assert llama_cpp.tool_failed("llama-bench", 1) == "llama-bench failed (exit status 1)"
