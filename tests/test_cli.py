"""The hfspec command line, in process through main() and once as a real subprocess."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tiny
import torch

import hfspec
import hfspec.decoding.loop
from hfspec import api
from hfspec.commands import cli
from hfspec.commands import generate as generate_command
from hfspec.cpu import fast
from hfspec.drafters import Drafter
from hfspec.errors import HfspecError
from hfspec.models.presets import Preset

PROMPT = "w10 w11 w12"
GENERATE_FLAGS = [
    "--target",
    "--draft",
    "--config",
    "--device",
    "--dtype",
    "--fast-kernels",
    "--no-fast-kernels",
    "--gamma",
    "--adaptive",
    "--ngram",
    "--no-ngram",
    "--draft-cost",
    "--tree",
    "--max-new-tokens",
    "--do-sample",
    "--temperature",
    "--top-k",
    "--top-p",
    "--repetition-penalty",
    "--seed",
    "--chat",
    "--no-chat",
    "--system",
    "--prompts-file",
    "--batch-size",
    "--stream",
    "--stats",
    "--json",
    "--draft-vocab",
    "--draft-bits",
    "--threads",
    "--arithmetic",
]
PROMPTS = ["w10 w11 w12", "w30", "w20 w21 w22 w23 w24 w25 w26"]  # different lengths, so batches are padded


pytestmark = pytest.mark.usefixtures("fresh_api_cache")


@pytest.fixture
def pair(model_dir):
    return ["--target", str(model_dir("llama", seed=0)), "--draft", str(model_dir("llama", seed=1))]


@pytest.fixture
def preset(model_dir, tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(
        json.dumps(
            {
                "name": "tiny",
                "target": str(model_dir("llama", seed=0)),
                "draft": str(model_dir("llama", seed=1)),
                "gamma": 3,
                "chat": True,
            }
        )
    )
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what building the fixtures printed
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hfspec: error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- help -----------------------------------------------------------------------------------------


def test_help_lists_the_commands(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "generate" in out and "COMMAND --help" in out


def test_generate_help_explains_every_flag(capsys):
    code, out, _ = run(capsys, "generate", "--help")
    assert code == 0
    for flag in GENERATE_FLAGS:
        assert flag in out, flag
    assert "'-' to read it from stdin" in out and "smollm2-offline" in out


def test_draft_vocab_takes_a_count(capsys):
    parser = cli.build_parser()
    assert "draft_vocab" not in cli._load_kwargs(parser.parse_args(["generate", "x"]))
    assert cli._load_kwargs(parser.parse_args(["generate", "x", "--draft-vocab", "4096"]))["draft_vocab"] == 4096
    code, _, err = run(capsys, "generate", "x", "--draft-vocab", "0")
    assert code == 2 and "expected a number of tokens >= 1" in err
    assert cli._load_kwargs(parser.parse_args(["generate", "x", "--draft-bits", "off"]))["draft_bits"] is None
    assert cli._load_kwargs(parser.parse_args(["generate", "x", "--draft-bits", "8"]))["draft_bits"] == 8


def test_arithmetic_is_passed_on_only_when_given(capsys):
    parser = cli.build_parser()
    assert "arithmetic" not in cli._load_kwargs(parser.parse_args(["generate", "x"]))
    assert cli._load_kwargs(parser.parse_args(["generate", "x", "--arithmetic", "int8"]))["arithmetic"] == "int8"
    code, _, err = run(capsys, "generate", "x", "--arithmetic", "int4")
    assert code == 2 and "invalid choice" in err


def test_no_command_prints_help_and_fails(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "usage: hfspec" in err


def test_help_and_bad_flags_answer_without_torch():
    # In a fresh process: importing the command line, --help and a bad flag load neither torch nor transformers
    # (seconds each), so they answer at once.
    script = """
import sys
loaded = lambda: sorted({"torch", "transformers"} & set(sys.modules))
from hfspec.commands import cli
print(loaded(), file=sys.stderr)
argvs = [["--help"], ["generate", "--help"], ["generate", "x", "--top-p", "2"], ["generate", "x", "--stream", "--json"]]
print([cli.main(argv) for argv in argvs], loaded(), file=sys.stderr)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: hfspec generate" in done.stdout and "--max-new-tokens" in done.stdout
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "[]" and lines[-1] == "[0, 0, 2, 2] []", done.stderr
    assert "must be in (0, 1]" in done.stderr and "pick one" in done.stderr


# -- generate -------------------------------------------------------------------------------------


def test_generate_prints_the_same_text_as_the_api(capsys, pair, model_dir):
    code, out, err = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "10", "--stats")
    expected = api.generate(
        PROMPT, target=str(model_dir("llama", seed=0)), draft=str(model_dir("llama", seed=1)), max_new_tokens=10
    )
    assert code == 0 and out == expected + "\n"
    assert "acceptance rate" in err and "mean accepted length" in err and "tokens/s" in err
    assert "γ per step" in err and "steps by γ" in err, "the γ that gamma='auto' chose, step by step"


def test_max_new_tokens_defaults_to_the_targets_generation_config(capsys, model_dir, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(model_dir("llama", seed=0), target)
    config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 6, "eos_token_id": None}))
    flags = ["--target", str(target), "--draft", str(model_dir("llama", seed=1)), "--json", "--gamma", "2"]
    code, out, _ = run(capsys, "generate", PROMPT, *flags)
    assert code == 0 and json.loads(out)["stats"]["committed"] == 6
    code, out, _ = run(capsys, "generate", PROMPT, *flags, "--max-new-tokens", "4")
    assert code == 0 and json.loads(out)["stats"]["committed"] == 4


def test_prompt_from_stdin(capsys, pair, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT + "\n"))
    code, from_stdin, _ = run(capsys, "generate", "-", *pair, "--max-new-tokens", "6")
    assert code == 0 and from_stdin == run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "6")[1]


def test_json_output(capsys, pair):
    code, out, _ = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "7", "--json", "--gamma", "2")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"text", "tokens", "stats", "settings"}
    assert len(data["tokens"]) == 7 and data["stats"]["committed"] == 7
    assert data["text"] == " ".join(f"w{t}" for t in data["tokens"])
    assert "acceptance_rate" in data["stats"] and "tokens_per_second" in data["stats"]
    assert data["settings"]["gamma"] == 2 and data["settings"]["do_sample"] is False
    histogram = data["stats"]["gamma_histogram"]
    assert sum(histogram) == data["stats"]["target_passes"] and len(histogram) == 3  # γ 2, less near the end


def test_fast_kernels_are_on_by_default_and_off_with_the_flag(capsys, pair, library):
    if library.isa == "scalar":
        pytest.skip("no vectorised CPU kernel here, so hfspec loads models without it")
    seen = []
    for flags in ([], ["--no-fast-kernels"]):
        code, out, err = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "5", "--json", "--stats", *flags)
        assert code == 0
        kernels_used = json.loads(out)["settings"]["fast_kernels"]
        seen.append((json.loads(out)["text"], kernels_used["target"]["on"], kernels_used["draft"]["on"]))
        assert ("fast kernels: target " + library.isa in err) == (not flags), err
    assert seen[0][1:] == (True, True) and seen[1][1:] == (False, False)
    assert seen[0][0] == seen[1][0]  # tiny fp32 models: the same greedy text with either kernel
    assert [fast.is_accelerated(g.target) for g in api._PAIRS.values()] == [True, False]


def test_gamma_auto_is_the_default_and_reports_its_choices(capsys, pair):
    code, out, _ = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "12", "--json")
    data = json.loads(out)
    assert code == 0 and data["settings"]["gamma"] == "auto"
    histogram = data["stats"]["gamma_histogram"]
    assert sum(histogram) == data["stats"]["target_passes"]
    assert data["stats"]["mean_gamma"] == pytest.approx(sum(g * n for g, n in enumerate(histogram)) / sum(histogram))
    code, explicit, _ = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "12", "--gamma", "auto")
    assert code == 0 and explicit.strip() == data["text"], "greedy text never depends on γ"


def test_stream_prints_the_same_text(capsys, pair):
    plain = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "9")[1]
    code, streamed, _ = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "9", "--stream")
    assert code == 0 and streamed == plain


def test_config_preset_with_chat(capsys, preset, pair):
    code, out, _ = run(capsys, "generate", PROMPT, "--config", preset, "--max-new-tokens", "8", "--json")
    data = json.loads(out)
    assert code == 0 and data["settings"]["chat"] is True and data["settings"]["gamma"] == 3
    assert data["text"] + "\n" == run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "8", "--chat")[1]
    no_chat = run(capsys, "generate", PROMPT, "--config", preset, "--max-new-tokens", "8", "--no-chat")[1]
    assert no_chat != data["text"] + "\n"


def test_adaptive_gamma_keeps_greedy_output(capsys, pair):
    fixed = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "12")[1]
    for policy in ("heuristic", "cost"):
        code, out, _ = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "12", "--adaptive", policy)
        assert code == 0 and out == fixed, policy


def test_adaptive_cost_estimates_the_draft_cost_from_what_the_drafter_reads(model_dir):
    target, tok = tiny.load(str(model_dir("llama", seed=0)))
    draft, _ = tiny.load(str(model_dir("llama", seed=1, layers=1)))
    args = argparse.Namespace(adaptive="cost", gamma=4, draft_cost=None)
    preset = Preset(name="tiny", target="t", draft="d")  # only its γ could matter, and --gamma is given
    model = generate_command._policy(args, preset, hfspec.SpeculativeGenerator(target, draft, tok))
    assert model.cost == pytest.approx(draft.num_parameters() / target.num_parameters()) and 0 < model.cost < 1
    assert generate_command._policy(args, preset, hfspec.SpeculativeGenerator(target, "ngram", tok)).cost == 0.0
    with pytest.raises(HfspecError, match="cannot estimate the cost of a drafter drafter; pass --draft-cost"):
        generate_command._policy(args, preset, hfspec.SpeculativeGenerator(target, Drafter(), tok))


def test_seed_reproducible_between_runs_and_equal_to_python(capsys, pair, model_dir):
    args = [
        "generate",
        "w10 w11",
        *pair,
        "--max-new-tokens",
        "12",
        "--do-sample",
        "--temperature",
        "1.0",
        "--gamma",
        "3",
    ]
    first = run(capsys, *args, "--seed", "5")[1]
    assert first == run(capsys, *args, "--seed", "5")[1]
    assert first != run(capsys, *args, "--seed", "6")[1]
    gen = hfspec.SpeculativeGenerator.from_pretrained(str(model_dir("llama", seed=0)), str(model_dir("llama", seed=1)))
    out = gen.generate([10, 11], max_new_tokens=12, do_sample=True, temperature=1.0, gamma=3, seed=5)
    assert first == gen.tokenizer.decode(out.sequences[0, out.prompt_length :], skip_special_tokens=True) + "\n"


# -- many prompts ---------------------------------------------------------------------------------


def test_prompts_file_rows_equal_each_prompt_alone(capsys, pair, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n  \n{PROMPTS[2]}\n")
    code, out, err = run(
        capsys,
        "generate",
        "--prompts-file",
        str(path),
        *pair,
        "--max-new-tokens",
        "8",
        "--batch-size",
        "2",
        "--json",
        "--stats",
    )
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == [1, 3, 5] and [r["prompt"] for r in rows] == PROMPTS
    for row, prompt in zip(rows, PROMPTS):
        assert set(row) == {
            "id",
            "prompt",
            "text",
            "tokens",
            "stop_reason",
            "accepted",
            "target_passes",
            "mean_accepted_length",
        }
        alone = json.loads(run(capsys, "generate", prompt, *pair, "--max-new-tokens", "8", "--json")[1])
        assert row["text"] == alone["text"] and row["tokens"] == len(alone["tokens"])
        assert row["stop_reason"] == alone["stats"]["rows"][0]["stop_reason"]
        assert row["tokens"] == row["accepted"] + row["target_passes"]
        assert row["mean_accepted_length"] == pytest.approx(row["tokens"] / row["target_passes"])
    assert "acceptance rate" in err and f"{sum(r['tokens'] for r in rows)} tokens in" in err and "3 prompts" in err


def test_jsonl_prompts_file_with_chat_keeps_ids(capsys, preset, tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"id": "a", "prompt": PROMPTS[0]}, {"prompt": PROMPTS[1]}, {"id": 7, "prompt": PROMPTS[2]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    code, out, _ = run(
        capsys,
        "generate",
        "--prompts-file",
        str(path),
        "--config",
        preset,
        "--max-new-tokens",
        "8",
        "--batch-size",
        "2",
        "--json",
    )
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == ["a", 2, 7] and [r["prompt"] for r in rows] == PROMPTS
    for row, prompt in zip(rows, PROMPTS):  # the preset turns chat on: each row as its prompt alone
        assert row["text"] + "\n" == run(capsys, "generate", prompt, "--config", preset, "--max-new-tokens", "8")[1]


def test_prompts_from_stdin_print_texts_between_blank_lines(capsys, pair, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(PROMPTS)))
    code, out, _ = run(capsys, "generate", "--prompts-file", "-", *pair, "--max-new-tokens", "6")
    alone = [run(capsys, "generate", p, *pair, "--max-new-tokens", "6")[1] for p in PROMPTS]
    assert code == 0 and out == "".join(text + "\n" for text in alone)


@pytest.mark.parametrize(
    "content, says",
    [
        ('{"prompt": "w10"}\n{"id": 2}\n', ':2: this JSON object has no "prompt" string'),
        ('{"prompt": "w10"}\n{"prompt": 5}\n', ':2: this JSON object has no "prompt" string'),
        ('{"prompt": "w10"}\n\nw11 w12\n', ":3: not a JSON object, but line 1 is"),
        ('w11 w12\n{"prompt": "w10"}\n', ":1: not a JSON object, but line 2 is"),
        ("\n  \n", "has no prompts"),
    ],
)
def test_bad_prompts_file_gives_one_line(capsys, pair, tmp_path, content, says):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    code, out, err = run(capsys, "generate", "--prompts-file", str(path), *pair)
    line = one_error_line(err)
    assert code == 2 and out == "" and str(path) in line and says in line


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--prompts-file", "/no/such/prompts.txt"], "prompts file '/no/such/prompts.txt' does not exist"),
        (["--prompts-file", "{file}", PROMPT], "give PROMPT or --prompts-file, not both"),
        (["--prompts-file", "{file}", "--stream"], "--stream needs a single PROMPT"),
        (["--prompts-file", "{file}", "--batch-size", "0"], "--batch-size: must be >= 1"),
        ([PROMPT, "--batch-size", "2"], "--batch-size only applies with --prompts-file"),
        ([], "no prompt: give PROMPT"),
    ],
)
def test_prompts_file_usage_errors_give_one_line(capsys, pair, tmp_path, argv, says):
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPT + "\n")
    argv = [str(path) if a == "{file}" else a for a in argv]
    code, out, err = run(capsys, "generate", *argv, *pair)
    assert code == 2 and out == "" and says in one_error_line(err)


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--gamma", "0"], "--gamma: must be >= 1 or 'auto'"),
        (["--gamma", "two"], "--gamma: expected an integer"),
        (["--gamma", "auto", "--adaptive", "heuristic"], "--adaptive chooses γ itself"),
        (["--temperature", "-0.5"], "--temperature: must be a finite number >= 0"),
        (["--temperature", "nan"], "--temperature: must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p: must be in (0, 1]"),
        (["--top-p", "1.01"], "--top-p: must be in (0, 1]"),
        (["--top-k", "-1"], "--top-k: must be >= 0"),
        (["--max-new-tokens", "-3"], "--max-new-tokens: must be >= 0"),
        (["--repetition-penalty", "0"], "--repetition-penalty: must be a number > 0"),
        (["--seed", "-1"], "--seed: must be >= 0"),
        (["--dtype", "fp8"], "--dtype: invalid choice"),
        (["--threads", "0"], "--threads: must be >= 1"),
        (["-t", "two"], "--threads: expected an integer"),
        (["--bogus"], "unrecognized arguments: --bogus (see 'hfspec generate --help')"),
    ],
)
def test_invalid_flag_values_give_one_line_and_exit_2(capsys, pair, flags, says):
    code, out, err = run(capsys, "generate", PROMPT, *pair, *flags)
    assert code == 2 and out == ""
    assert says in one_error_line(err)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--target", "/no/such/model", "--draft", "/no/such/draft"], "target path '/no/such/model' does not exist"),
        (["--target", "x"], "--draft is missing"),
        (["--config", "no-such-preset"], "no preset named 'no-such-preset'"),
        (["--config", "gpt2-xl", "--target", "x", "--draft", "y"], "use --config or --target/--draft, not both"),
        (["--stream", "--json"], "pick one"),
        (["--draft-cost", "0.1"], "--draft-cost only applies with --adaptive cost"),
    ],
)
def test_usage_errors_give_one_line_and_exit_2(capsys, argv, says):
    code, _, err = run(capsys, "generate", PROMPT, *argv)
    assert code == 2 and says in one_error_line(err)


def _truncated_gguf(path: Path) -> Path:
    import gguf_files

    data = gguf_files.write(path.parent / "whole", "llama", "Q8_0", hidden=64, layers=1).read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda p: p.write_text("not a model\n"), "'{}' is not a model: a file, but not a GGUF file"),
        (lambda p: p.write_bytes(b""), "'{}' is an empty file, not a model"),
        (_truncated_gguf, "'{}' is a truncated GGUF file (its tensor data ends at byte"),
        (lambda p: p.mkdir(), "directory '{}' holds no model"),
    ],
    ids=["text", "empty", "truncated", "directory"],
)
def test_a_target_that_is_not_a_model_gets_one_line(capsys, tmp_path, make, says):
    path = tmp_path / "model.gguf"
    make(path)
    code, out, err = run(capsys, "generate", PROMPT, "--target", str(path), "--draft", "ngram")
    line = one_error_line(err)
    assert code == 2 and out == "" and says.format(path) in line, line
    assert line.endswith("a .gguf file or a hub name") or "a .gguf file or a hub name, or" in line


def test_threads_reach_torch_and_the_json_and_are_restored(capsys, pair, monkeypatch):
    seen = []
    real = hfspec.decoding.loop.Call.run

    def run_loop(self, *args):
        seen.append(torch.get_num_threads())
        return real(self, *args)

    monkeypatch.setattr(hfspec.decoding.loop.Call, "run", run_loop)
    before = torch.get_num_threads()
    for flags, threads in (([], before), (["--threads", "2"], 2), (["-t", "1"], 1)):
        code, out, _ = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "4", "--gamma", "2", "--json", *flags)
        assert code == 0 and json.loads(out)["settings"]["threads"] == threads and seen[-1] == threads
        assert torch.get_num_threads() == before


def test_errors_from_the_generator_give_one_line(capsys, pair):
    code, _, err = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "5000")
    assert code == 2 and "context window" in one_error_line(err)


@pytest.mark.parametrize("error", [RuntimeError, ValueError, TypeError, OSError, KeyError])
def test_an_internal_error_shows_its_traceback_and_asks_for_a_report(capsys, pair, monkeypatch, error):
    def broken(self, *args, **kwargs):
        raise error("something inside went wrong")

    monkeypatch.setattr(hfspec.decoding.loop.Call, "verify", broken)
    code, out, err = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "4", "--gamma", "2")
    assert code == cli.EXIT_BUG == 1 and out == ""
    assert "Traceback (most recent call last)" in err and f"{error.__name__}: " in err and "went wrong" in err
    assert "hfspec: error:" not in err and "this is a bug: please report it" in err and hfspec.__version__ in err


def test_bad_preset_file_gives_one_line(capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"name": "bad",\n "target": "t", "draft": "d", "gama": 2}')
    code, _, err = run(capsys, "generate", PROMPT, "--config", str(path))
    assert code == 2 and "unknown key(s) gama" in one_error_line(err)


def test_ctrl_c_while_streaming_prints_the_partial_text(capsys, pair, monkeypatch):
    full = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "30", "--gamma", "2")[1]
    real, calls = hfspec.decoding.loop.forward, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 12:  # prefill is 2 calls, each step 3: a few steps have committed tokens
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(hfspec.decoding.loop, "forward", interrupted)
    code, out, err = run(capsys, "generate", PROMPT, *pair, "--max-new-tokens", "30", "--gamma", "2", "--stream")
    assert code == 130 and "interrupted" in err
    assert out.endswith("\n") and out.count("\n") == 1
    partial = out.strip()
    assert 3 <= len(partial.split()) < 30 and full.startswith(partial)


# -- optional commands ----------------------------------------------------------------------------


def test_optional_commands_are_guarded(capsys, monkeypatch):
    real = cli.importlib.import_module

    def fake(name, *args):
        if name == "hfspec.training":
            raise ModuleNotFoundError("No module named 'hfspec.training'", name="hfspec.training")
        if name == "hfspec.bench":
            raise SyntaxError("invalid syntax")
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", fake)
    assert run(capsys, "generate", "--help")[0] == 0
    code, _, err = run(capsys, "distill", "--help")
    assert code == 2 and "invalid choice: 'distill'" in one_error_line(err)
    code, _, err = run(capsys, "bench", "--anything")
    assert code == 2 and "'hfspec bench' is unavailable: SyntaxError" in one_error_line(err)


@pytest.mark.parametrize("name", cli.OPTIONAL_COMMANDS)
def test_optional_commands_are_registered_when_present(capsys, name):
    pytest.importorskip(cli.OPTIONAL_COMMANDS[name])
    code, out, _ = run(capsys, name, "--help")
    assert code == 0 and f"usage: hfspec {name}" in out
    # 'hfspec --help' lists it without importing its module, with the help line the module gives it
    commands = next(a for a in cli.build_parser(name)._actions if isinstance(a, argparse._SubParsersAction))
    assert {a.dest: a.help for a in commands._choices_actions}[name] == cli.OPTIONAL_HELP[name]


# -- a real process -------------------------------------------------------------------------------


def test_subprocess_stream_chat_and_json(pair, preset, tmp_path, library):
    root = Path(__file__).resolve().parent.parent
    # One thread each: the three processes run side by side on what may be two cores.
    env = {**os.environ, "HFSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    # A fresh cache, but with the kernel the session built (building it again would take most of the test's time).
    kernels_dir = tmp_path / "cache" / "kernels"
    kernels_dir.mkdir(parents=True, mode=0o755)
    shutil.copy2(library.path, kernels_dir / library.path.name)

    def hfspec_cmd(*argv: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "hfspec.commands.cli", "generate", PROMPT, *argv],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
        out, err = proc.communicate(timeout=300)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # The three run side by side: most of each one's time is importing torch and transformers.
    streamed, as_json, bad = map(
        finished,
        [
            hfspec_cmd(*pair, "--max-new-tokens", "8", "--chat", "--stream"),
            hfspec_cmd("--config", preset, "--max-new-tokens", "8", "--json"),
            hfspec_cmd(*pair, "--top-p", "2"),
        ],
    )
    assert streamed.returncode == 0, streamed.stderr
    assert as_json.returncode == 0, as_json.stderr
    assert streamed.stdout == json.loads(as_json.stdout)["text"] + "\n"
    assert bad.returncode == 2 and bad.stdout == "" and one_error_line(bad.stderr)
