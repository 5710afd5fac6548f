"""From runs to the figures of the report: paired ratios, acceptance, α, predictions, mismatches.

Speed-ups are medians of per-prompt ratios of tokens per second: the runs of one prompt
are interleaved, so a ratio cancels most of the machine's drift and a slow prompt does
not dominate. α is fitted to the measured tokens per target pass (Leviathan et al.,
arXiv 2211.17192, Thm 3.8), not read off the share of drafts accepted.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from hfspec.bench.field import Contender
from hfspec.bench.measure import Run
from hfspec.decoding.stats import Stats
from hfspec.policy import alpha_from_tokens_per_pass, predicted_speedup


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Median over prompts of a[i] / b[i]: paired, so a slow prompt does not dominate."""
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    return statistics.median(ratios) if ratios else None


def spread(values: Sequence[float]) -> dict[str, float]:
    values = sorted(values)
    if not values:
        return {}
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "p25": q1, "p75": q3, "min": values[0], "max": values[-1]}


def acceptance(contender: Contender, runs: Sequence[Run]) -> dict[str, Any]:
    """α, tokens per target pass, mean γ and acceptance by draft position.

    hfspec counts these itself. For transformers they come from forward counts:
    each assisted round is one target forward (the first also reads the prompt)
    and γ draft forwards, and commits its accepted drafts plus one token.
    Prompt lookup drafts without forwards, so only its tokens per pass are known.
    """
    if contender.kind == "plain":
        return {
            "acceptance_rate": None,
            "mean_accepted_length": 1.0,
            "mean_gamma": 0.0,
            "acceptance_by_position": [],
            "gamma_histogram": [],
            "tree_steps": None,
            "tree_nodes": None,
        }
    histogram: list[int] = []
    # hfspec's tree steps (counted in the histogram at their depth); transformers drafts no trees.
    trees: dict[str, int | None] = {"tree_steps": None, "tree_nodes": None}
    if contender.kind == "hfspec":
        stats = Stats.combine([r.stats for r in runs])
        drafted, accepted, passes = stats.drafted, stats.accepted, stats.target_passes
        by_position = list(stats.acceptance_by_position)
        committed = stats.committed
        histogram = list(stats.gamma_histogram)
        trees = {"tree_steps": sum(stats.depth_histogram), "tree_nodes": stats.tree_nodes}
    else:
        passes = sum(r.target_calls for r in runs)
        committed = sum(r.new_tokens for r in runs)
        accepted = max(0, committed - passes)
        drafted = sum(r.draft_calls for r in runs) if contender.kind == "assisted" else None
        by_position = []
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": committed / passes if passes else None,
        "mean_gamma": drafted / passes if passes and drafted is not None else None,
        "acceptance_by_position": by_position,
        "gamma_histogram": histogram,
        **trees,
    }


def prediction(
    alpha: float | None, gamma: float | None, cost: float, verify_cost: dict[int, float]
) -> tuple[float | None, float | None, int | None]:
    """Predicted speed-up with v = 1 and with the measured v(γ); adaptive runs use their mean γ, rounded."""
    if alpha is None or not gamma:
        return None, None, None
    g = max(1, round(gamma))
    v = verify_cost.get(g)
    if v is None and verify_cost:
        v = verify_cost[min(verify_cost, key=lambda k: abs(k - g))]
    return predicted_speedup(alpha, g, cost), predicted_speedup(alpha, g, cost, v or 1.0), g


def greedy_checks(runs: Sequence[Run], plain: Sequence[Run], plain_kernel: Sequence[Run] | None) -> dict[str, Any]:
    """Greedy tokens against the target's own generate(): on torch's kernels (``greedy_mismatches``) and, where the
    target runs hfspec's, on those (``greedy_mismatches_vs_kernel``: the reference that holds bit for bit)."""
    out = {"greedy_mismatches": mismatches([r.tokens[0] for r in plain], [r.tokens[0] for r in runs])}
    if plain_kernel is not None:
        out["greedy_mismatches_vs_kernel"] = mismatches(
            [r.tokens[0] for r in plain_kernel], [r.tokens[0] for r in runs]
        )
    return out


def tree_summary(
    runs: Sequence[Run],
    plain: Sequence[Run],
    gamma0: Sequence[Run] | None,
    greedy: bool,
    plain_kernel: Sequence[Run] | None = None,
) -> dict[str, Any]:
    """One point of the tree sweep: speed, tokens per target pass, nodes verified per pass and the acceptance of
    tree steps by depth (of the steps whose path reached depth d - 1, the share that kept a node at depth d)."""
    stats = Stats.combine([r.stats for r in runs])
    tps = [r.tokens_per_second for r in runs]
    passes = stats.target_passes
    hist = list(stats.depth_histogram)
    reached = [sum(hist[d:]) for d in range(len(hist))]  # steps whose path is at least d deep
    row = {
        "tokens_per_second": statistics.median(tps) if tps else None,
        "speedup_vs_plain": median_ratio(tps, [r.tokens_per_second for r in plain]),
        "speedup_vs_hfspec_g0": median_ratio(tps, [r.tokens_per_second for r in gamma0]) if gamma0 else None,
        "tokens_per_pass": stats.committed / passes if passes else None,
        "nodes_per_pass": stats.tree_nodes / passes if passes else None,
        "acceptance_by_depth": [reached[d] / reached[d - 1] for d in range(1, len(hist)) if reached[d - 1]],
        "depth_histogram": hist,
    }
    if greedy:
        row.update(greedy_checks(runs, plain, plain_kernel))
    return row


def mismatches(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> list[dict[str, int]]:
    """Prompts whose tokens differ from the reference, with the first differing position."""
    found = []
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        ref, out = list(ref), list(out)
        if ref != out:
            first = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
            found.append({"prompt": i, "position": first, "reference_length": len(ref), "length": len(out)})
    return found


def summarize(
    contender: Contender,
    runs: Sequence[Run],
    plain: Sequence[Run],
    assisted: Sequence[Run] | None,
    cost: float,
    verify_cost: dict[int, float],
    greedy: bool,
    assisted_default: Sequence[Run] | None = None,
    gamma0: Sequence[Run] | None = None,
    plain_kernel: Sequence[Run] | None = None,
) -> dict[str, Any]:
    """Everything reported for one contender in one mode (``assisted*`` are None without a draft model;
    ``gamma0``, hfspec at γ = 0 on the same kernels, is None when skipped; ``plain_kernel``, the target's own
    generate() on hfspec's kernels, is None where the target runs torch's)."""
    tps = [r.tokens_per_second for r in runs]
    acc = acceptance(contender, runs)
    vs_plain = median_ratio(tps, [r.tokens_per_second for r in plain])
    gamma = contender.gamma or acc["mean_gamma"]
    # α for the cost model, fitted at the same (rounded) γ that the prediction uses.
    alpha = (
        alpha_from_tokens_per_pass(acc["mean_accepted_length"], max(1, round(gamma)))
        if gamma and acc["mean_accepted_length"]
        else None
    )
    pred, pred_v, g = prediction(alpha, gamma, cost, verify_cost)
    row = {
        "kind": contender.kind,
        "schedule": contender.schedule,
        "gamma": contender.gamma,
        "drafter": contender.drafter,
        "tokens_per_second": spread(tps),
        "speedup_vs_plain": vs_plain,
        "speedup_vs_hfspec_g0": median_ratio(tps, [r.tokens_per_second for r in gamma0]) if gamma0 else None,
        "speedup_vs_assisted": median_ratio(tps, [r.tokens_per_second for r in assisted]) if assisted else None,
        "speedup_vs_assisted_default": (
            median_ratio(tps, [r.tokens_per_second for r in assisted_default]) if assisted_default else None
        ),
        **acc,
        "alpha": alpha,
        "prediction_gamma": g,
        "predicted_speedup": pred,
        "predicted_speedup_v": pred_v,
        "efficiency": vs_plain / pred_v if vs_plain and pred_v else None,
        "new_tokens": sum(r.new_tokens for r in runs),
        "seconds": sum(r.seconds for r in runs),
    }
    if greedy:
        row.update(greedy_checks(runs, plain, plain_kernel))
    return row
