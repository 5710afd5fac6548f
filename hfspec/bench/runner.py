"""The benchmark: costs first, then per mode the field over every prompt, the γ and tree sweeps and the batch row.

Contenders run interleaved per prompt (A B C A B C …) after warm-up runs, so slow drifts
of the machine hit all of them alike.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from hfspec.bench.field import (
    GAMMA0,
    MAIN,
    PLAIN_KERNEL,
    Contender,
    Mode,
    Settings,
    contenders,
    encode,
    tree_contenders,
)
from hfspec.bench.measure import Bench, Run
from hfspec.bench.summary import mismatches, summarize, tree_summary
from hfspec.cpu import fast
from hfspec.measure.costs import rollback_cost
from hfspec.models.recurrent import is_recurrent
from hfspec.policy import predicted_speedup

SWEEP_KEYS = (
    "speedup_vs_plain",
    "speedup_vs_hfspec_g0",
    "speedup_vs_assisted",
    "acceptance_rate",
    "alpha",
    "mean_accepted_length",
    "predicted_speedup",
    "predicted_speedup_v",
    "efficiency",
    "acceptance_by_position",
)


def run_bench(bench: Bench, prompts: Sequence[dict[str, str]], settings: Settings) -> dict[str, Any]:
    """Measure costs, then every mode: the field per prompt, the γ sweep and the batch row."""
    encoded = [encode(bench.tokenizer, p["prompt"]) for p in prompts]
    gammas = tuple(sorted({*settings.gammas, settings.gamma}))
    costs = bench.measure_costs(encoded[0], range(1, max(gammas) + 1), settings.cost_repeats)
    main, sweep = field_of(bench, settings, gammas)
    # The main hfspec contender is the sweep's point at γ; without it the sweep has no point there.
    gammas = tuple(g for g in gammas if g != settings.gamma or any(c.name == "hfspec" for c in main))
    # Trees where the main pair drafts and verifies them exactly; a chain-only pair gets no tree sweep.
    trees = tree_contenders(settings.trees) if bench.spec.drafts_trees() else []
    result: dict[str, Any] = {"costs": costs, "auto_costs": bench.auto_costs(encoded[0]), "modes": {}}
    for m, mode in enumerate(settings.modes):
        seed = bench.seed + 1000 * m
        runs = run_field(bench, main + sweep + trees, encoded, mode, settings, seed)
        greedy = not mode.do_sample
        table = {
            c.name: summarize(
                c,
                runs[c.name],
                runs["plain"],
                runs.get("assisted"),
                bench.cost,
                bench.verify_cost,
                greedy,
                runs.get("assisted-default"),
                runs.get(GAMMA0),
                runs.get(PLAIN_KERNEL),
            )
            for c in main + sweep
        }
        by_gamma = {settings.gamma: "hfspec", **{c.gamma: c.name for c in sweep}}
        result["modes"][mode.name] = out = {
            "label": mode.label(),
            **mode.kwargs(),
            "contenders": {c.name: table[c.name] for c in main},
            "sweep": [
                {
                    "gamma": g,
                    **{k: table[by_gamma[g]][k] for k in SWEEP_KEYS},
                    "tokens_per_second": table[by_gamma[g]]["tokens_per_second"]["median"],
                }
                for g in gammas
            ],
            "per_prompt": [
                {
                    "id": p["id"],
                    "kind": p["kind"],
                    "prompt_tokens": len(e),
                    **{c.name: round(runs[c.name][i].tokens_per_second, 3) for c in main},
                }
                for i, (p, e) in enumerate(zip(prompts, encoded))
            ],
        }
        out["tree_sweep"] = [
            {
                "nodes": c.tree,
                **tree_summary(runs[c.name], runs["plain"], runs.get(GAMMA0), greedy, runs.get(PLAIN_KERNEL)),
            }
            for c in trees
        ]
        if greedy:
            for key, suffix in (("greedy_mismatches", ""), ("greedy_mismatches_vs_kernel", "_vs_kernel")):
                if PLAIN_KERNEL in runs or not suffix:
                    out["sweep_mismatches" + suffix] = {c.name: table[c.name][key] for c in sweep}
                    out["tree_mismatches" + suffix] = {f"hfspec-t{t['nodes']}": t[key] for t in out["tree_sweep"]}
        if settings.batch_size:
            rows = [encoded[i % len(encoded)] for i in range(settings.batch_size)]
            out["batch"] = run_batch(bench, rows, mode, settings, seed)
    if is_recurrent(bench.target):
        result["rollback"] = rollback_report(bench, encoded[0], gammas, result, settings.cost_repeats)
    return result


def field_of(bench: Bench, settings: Settings, gammas: Sequence[int]) -> tuple[list[Contender], list[Contender]]:
    """The main field (less what ``settings.skip`` names; plain, and plain-kernel where the target runs hfspec's
    kernels, always run) and the sweep, for this bench."""
    extra = [name for name in bench.specs if name != MAIN]
    # transformers assists only a model draft, and refuses stateful (recurrent) targets.
    assists = not is_recurrent(bench.target)
    main, sweep = contenders(
        settings.gamma,
        gammas,
        extra,
        assisted=assists and bench.draft is not None,
        lookup_tokens=settings.lookup_tokens if assists else None,
        kernels=bool(fast.describe(bench.target)["on"]),  # FastLinears, or GGUF blocks on the quantized kernels
    )
    return [c for c in main if c.kind == "plain" or c.name not in settings.skip], sweep


def run_field(
    bench: Bench,
    field: Sequence[Contender],
    encoded: Sequence[Sequence[int]],
    mode: Mode,
    settings: Settings,
    seed: int,
) -> dict[str, list[Run]]:
    """Warm-up passes, then every prompt with every contender in turn (A B C A B C …); the runs by contender.

    The lookup stores start the mode empty and only ever hold outputs of other prompts (``hfspec.bench.stores``).
    """
    bench.stores.forget()
    progress = {"disable": not settings.progress, "file": sys.stderr}
    for i in tqdm(range(settings.warmup), desc=f"warm-up ({mode.name})", **progress):
        for c in field:
            bench.run(c, [encoded[i % len(encoded)]], mode, seed)
    runs: dict[str, list[Run]] = {c.name: [] for c in field}
    for i, ids in enumerate(tqdm(encoded, desc=f"prompts ({mode.name})", **progress)):
        for c in field:
            runs[c.name].append(bench.run(c, [ids], mode, seed + i))
    return runs


def rollback_report(
    bench: Bench, context: Sequence[int], gammas: Sequence[int], result: dict[str, Any], repeats: int
) -> dict[str, Any]:
    """What rolling a recurrent target back costs: v(γ) without and with the rollback (snapshot, and the replay
    of a rejection at the acceptance each mode measured), and the predicted speed-up either way."""
    out: dict[str, Any] = {}
    for g in gammas:
        rc = rollback_cost(bench.target, context, g, repeats=max(2, repeats // 2), device=bench.device)
        row: dict[str, Any] = {**rc.to_dict(), "modes": {}}
        for name, mode in result["modes"].items():
            alpha = measured_alpha(mode["contenders"])
            if alpha is not None:
                row["modes"][name] = {
                    "alpha": alpha,
                    "v_with_rollback": rc.expected(alpha),
                    "predicted_speedup": predicted_speedup(alpha, g, bench.cost, rc.verify),
                    "predicted_speedup_with_rollback": predicted_speedup(alpha, g, bench.cost, rc.expected(alpha)),
                }
        out[str(g)] = row
    return out


def measured_alpha(rows: dict[str, dict[str, Any]]) -> float | None:
    """α of the fixed-γ ``hfspec`` contender, else of ``hfspec-auto``; None when --skip left out both."""
    # Looked up in turn: a .get() with the other as its fallback would index a skipped contender first.
    for name in ("hfspec", "hfspec-auto"):
        if name in rows:
            return rows[name]["alpha"]
    return None


def run_batch(bench: Bench, rows: Sequence[Sequence[int]], mode: Mode, settings: Settings, seed: int) -> dict[str, Any]:
    """hfspec on a whole batch vs hfspec one prompt at a time vs the target's batched ``generate()``.

    Rows repeat when the batch is larger than the prompts. Every call starts with a lookup store
    free of the batch's own outputs, but with ``--draft ngram`` a row that finishes within a batched
    call enters the store at once, where a repeat of it still running may find it.
    """
    hfspec = Contender("hfspec-auto", "hfspec", None, "auto")
    field: dict[str, tuple[Contender, bool]] = {
        "plain_batched": (Contender("plain", "plain", None, "-"), False),
        "hfspec_batched": (hfspec, False),
        "hfspec_serial": (hfspec, True),
    }
    for name, (c, serial) in field.items():  # warm-up at this batch shape
        bench.run(c, rows, mode, seed, serial=serial)
    runs: dict[str, list[Run]] = {name: [] for name in field}
    for r in range(settings.batch_repeats):
        for name, (c, serial) in field.items():
            runs[name].append(bench.run(c, rows, mode, seed + r, serial=serial))
    tps = {name: statistics.median(x.tokens_per_second for x in rs) for name, rs in runs.items()}
    out: dict[str, Any] = {
        "batch_size": len(rows),
        "repeats": settings.batch_repeats,
        "gamma": "auto",
        "tokens_per_second": tps,
        "batched_vs_serial": tps["hfspec_batched"] / tps["hfspec_serial"],
        "batched_vs_plain_batched": tps["hfspec_batched"] / tps["plain_batched"],
        "serial_vs_plain_batched": tps["hfspec_serial"] / tps["plain_batched"],
    }
    if not mode.do_sample:
        out["greedy_mismatches"] = mismatches(runs["plain_batched"][0].tokens, runs["hfspec_batched"][0].tokens)
    return out
