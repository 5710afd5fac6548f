"""llama.cpp's own tools as the CPU reference line: their command lines, and their printed output parsed.

Nothing here runs llama.cpp or needs it: ``scripts/build_llama_cpp.py`` builds its tools from a pinned source
distribution, and ``scripts/llama_cpp_bench.py`` and ``scripts/serve_bench.py --llama-server`` run them and read
what they print through these functions.

- ``llama-bench -o json`` (or its default markdown table): tokens per second of prompt processing ``ppK`` (K
  tokens in one forward) and generation ``tgN``, each at a context depth. From them the verification costs
  v(k) = t(k) / t(1) = k · pp1 / ppk: what a forward over k tokens costs in single-token steps.
- ``llama-speculative-simple``: the generated text on stdout (after the echoed prompt), and on stderr the lines
  ``encoded N tokens in S seconds``, ``decoded N tokens in S seconds``, ``n_draft``, ``n_drafted``, ``n_accept``.
- ``llama-server``: its command line for a GGUF target, optionally with a draft model (``--spec-type
  draft-simple``; ``--draft-max`` and ``--draft-min`` were removed from llama.cpp in 2026).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BenchRow",
    "SpeculativeRun",
    "bench_command",
    "parse_bench",
    "parse_speculative",
    "server_command",
    "speculative_command",
    "tool_failed",
    "verification_costs",
]


@dataclass(frozen=True)
class BenchRow:
    """One llama-bench test: ``n_prompt`` tokens processed in one forward, or ``n_gen`` generated one by one."""

    n_prompt: int
    n_gen: int
    n_depth: int  # tokens already in the context when the test runs
    tok_s: float  # mean tokens per second over the repetitions
    stddev: float

    @property
    def name(self) -> str:
        test = f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"
        return f"{test} @ d{self.n_depth}" if self.n_depth else test


# "| qwen2 1.5B Q4_K - Medium | 1.04 GiB | 1.54 B | CPU | 2 | pp4 @ d256 | 57.01 ± 0.33 |"
_MARKDOWN_TEST = re.compile(r"^(pp|tg)(\d+)(?:\s*@\s*d(\d+))?$")
_MARKDOWN_SPEED = re.compile(r"^([\d.]+)\s*(?:±\s*([\d.]+))?$")


def parse_bench(text: str) -> list[BenchRow]:
    """The tests in llama-bench's output: its JSON (``-o json``, a list of objects) or its markdown table."""
    stripped = text.strip()
    if stripped.startswith("["):
        return [
            BenchRow(
                int(r["n_prompt"]), int(r["n_gen"]), int(r.get("n_depth", 0)), float(r["avg_ts"]), float(r["stddev_ts"])
            )
            for r in json.loads(stripped)
        ]
    rows, header = [], None
    for line in stripped.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            if "test" in cells and "t/s" in cells:
                header = cells
            continue
        if len(cells) != len(header) or set(line.strip()) <= set("|-: "):
            continue
        test = _MARKDOWN_TEST.match(cells[header.index("test")])
        speed = _MARKDOWN_SPEED.match(cells[header.index("t/s")])
        if test is None or speed is None:
            raise ValueError(f"unexpected llama-bench row: {line!r}")
        kind, n, depth = test.group(1), int(test.group(2)), int(test.group(3) or 0)
        rows.append(
            BenchRow(
                n if kind == "pp" else 0,
                n if kind == "tg" else 0,
                depth,
                float(speed.group(1)),
                float(speed.group(2) or 0.0),
            )
        )
    if header is None:
        raise ValueError("no llama-bench table (a line with 'test' and 't/s' columns) or JSON list in the text")
    return rows


def verification_costs(rows: list[BenchRow], depth: int) -> dict:
    """pp and tg at ``depth`` and v(k) = k · pp1 / ppk, also against tg (``v_tg``: k · tg / ppk), by k."""
    pp = {r.n_prompt: r.tok_s for r in rows if r.n_prompt and r.n_depth == depth}
    tg = next((r.tok_s for r in rows if r.n_gen and r.n_depth == depth), None)
    out: dict = {"depth": depth, "pp": pp, "tg": tg}
    out["v"] = {k: k * pp[1] / s for k, s in pp.items()} if 1 in pp else None
    out["v_tg"] = {k: k * tg / s for k, s in pp.items()} if tg else None
    return out


@dataclass(frozen=True)
class SpeculativeRun:
    """What one llama-speculative-simple run printed."""

    prompt_tokens: int
    prompt_s: float  # the prompt through the target and the draft
    new_tokens: int
    decode_s: float
    n_max: int  # --spec-draft-n-max
    drafted: int  # draft tokens proposed (those of discarded drafts left out, as it counts them)
    accepted: int
    text: str  # the generated text (without the echoed prompt)

    @property
    def decode_tok_s(self) -> float:
        return self.new_tokens / self.decode_s

    @property
    def end_to_end_tok_s(self) -> float:
        return self.new_tokens / (self.prompt_s + self.decode_s)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


_LOG_PREFIX = r"^(?:\S*\s+)?(?:[IWE]\s+)?"  # --log-prefix / --log-timestamps put these before a line


def _stat(pattern: str, text: str) -> re.Match:
    found = re.search(_LOG_PREFIX + pattern, text, re.MULTILINE)
    if found is None:
        raise ValueError(f"llama-speculative-simple printed no line matching {pattern!r}")
    return found


def parse_speculative(stdout: str, stderr: str, prompt: str) -> SpeculativeRun:
    """A llama-speculative-simple run from its two streams; ``prompt`` is the ``-p`` text it echoes first."""
    enc = _stat(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr)
    dec = _stat(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr)
    text = stdout
    body = text.lstrip("\n")
    if body.startswith(prompt):  # the pieces of the prompt's tokens, which spell the prompt
        text = body[len(prompt) :]
    return SpeculativeRun(
        prompt_tokens=int(enc.group(1)),
        prompt_s=float(enc.group(2)),
        new_tokens=int(dec.group(1)),
        decode_s=float(dec.group(2)),
        n_max=int(_stat(r"n_draft\s*=\s*(\d+)", stderr).group(1)),
        drafted=int(_stat(r"n_drafted\s*=\s*(\d+)", stderr).group(1)),
        accepted=int(_stat(r"n_accept\s*=\s*(\d+)", stderr).group(1)),
        text=text.removesuffix("\n\n"),
    )


def bench_command(binary: Path, model: Path, *, threads: int, ks: list[int], new: int, depth: int, reps: int):
    """llama-bench: pp at each k and tg of ``new`` tokens, all at ``depth``, as JSON on stdout."""
    return [str(binary), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, ks))] + [
        "-n",
        str(new),
        "-d",
        str(depth),
        "-r",
        str(reps),
        "-o",
        "json",
    ]


def speculative_command(
    binary: Path, target: Path, draft: Path, prompt: str, *, threads: int, new: int, n_max: int, context: int = 4096
) -> list[str]:
    """llama-speculative-simple, greedy (``--temp 0``: the target's argmax), drafting with ``draft``."""
    return [str(binary), "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple"] + [
        "--spec-draft-n-max",
        str(n_max),
        "-p",
        prompt,
        "-n",
        str(new),
        "-t",
        str(threads),
        "-c",
        str(context),
        "--temp",
        "0",
        "--seed",
        "0",
    ]


def server_command(
    binary: Path,
    target: Path,
    *,
    port: int,
    threads: int,
    slots: int,
    slot_context: int = 1024,
    draft: Path | None = None,
    n_max: int | None = None,
) -> list[str]:
    """llama-server on loopback with ``slots`` parallel slots of ``slot_context`` tokens each, plain or with
    ``draft`` (draft-simple, its default n-max unless ``n_max``); no web UI, no prompt cache kept across requests."""
    command = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]
    command += ["-tb", str(threads), "-np", str(slots), "-c", str(slots * slot_context), "--no-webui"]
    command += ["--no-cache-prompt", "--cache-ram", "0"]
    if draft is not None:
        command += ["-md", str(draft), "--spec-type", "draft-simple", "-td", str(threads), "-tbd", str(threads)]
        if n_max is not None:
            command += ["--spec-draft-n-max", str(n_max)]
    return command


def tool_failed(tool: str, status: int, stderr: str = "") -> str:
    """The error for a llama.cpp tool that exited with ``status``; one killed by a signal is told how to build a
    portable one."""
    message = f"{tool} failed (exit status {status})"
    if status < 0:
        message += (
            f": killed by signal {-status}. A native build can die on some CPUs (seen: a general protection fault "
            "in its AMX code on a Sapphire Rapids Xeon, for any forward of 2 or more tokens); build without "
            "-march=native with `python scripts/build_llama_cpp.py --portable` and pass the folder it prints as --bin"
        )
    return message + (f"\n{stderr[-2000:]}" if stderr else "")
