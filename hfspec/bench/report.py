"""The report of a bench run: the table printed for people, and the plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _histogram(counts: Sequence[int]) -> str:
    return " ".join(f"{g}:{n}" for g, n in enumerate(counts) if n) or "-"


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report: the machine and the costs, then each mode, then a recurrent target's rollback."""
    lines = _cost_lines(result)
    for name, mode in result["modes"].items():
        lines += _mode_lines(name, mode)
    if "rollback" in result:
        lines += _rollback_lines(result["rollback"])
    return "\n".join(lines)


def _cost_lines(result: dict[str, Any]) -> list[str]:
    """The machine first (only ratios measured on one machine compare), the kernels, then c and v(γ) as each side
    measured them: with the CPU kernel and eager where the pair runs it."""
    env, costs = result.get("environment", {}), result["costs"]
    lines = []
    if env:
        lines.append(
            f"machine: {env.get('cpu')}, {env.get('threads')} torch threads, device {env.get('device')}, "
            f"{env.get('dtype')}; torch {env.get('torch')}, transformers {env.get('transformers')}"
        )
    eager = costs.get("eager")
    lines += [_kernel_line(costs.get("fast_kernels"))] if costs.get("fast_kernels") else []
    lines += _step_lines(costs, "with the kernel" if eager else "")
    if eager:
        lines += _step_lines(eager, "eager: torch's linears")
        lines.append(f"the kernel's one-token target step: {costs['step_speedup']:.2f}× the eager one")
    for name, auto in result.get("auto_costs", {}).items():
        lines.append(
            f"gamma=auto, {name}: measured in {auto['seconds_measuring']:.2f} s: target step "
            f"{auto['measured_target_ms']['1']:.2f} ms, drafting step {auto['measured_draft_ms']:.2f} ms; "
            "v = "
            + ", ".join(
                f"{g}: {1e-3 * t / (1e-3 * auto['measured_target_ms']['1']):.2f}"
                for g, t in list(auto["measured_target_ms"].items())[1:]
            )
        )
    return lines


def _kernel_line(described: dict[str, Any]) -> str:
    """Whether each model runs hfspec's CPU kernel (``hfspec.fast.describe``)."""
    parts = [
        f"{role} {k['isa']}, {k['layers']} layers, {k['bytes_added']} bytes added"
        if k["on"]
        else f"{role} {k['reason']}"
        for role, k in described.items()
    ]
    return "fast kernels: " + "; ".join(parts)


def _step_lines(costs: dict[str, Any], label: str) -> list[str]:
    """The one-token steps, c and v(γ) of one measurement."""
    where = f" ({label})" if label else ""
    return [
        f"target step {costs['target_step_ms']:.2f} ms, draft step {costs['draft_step_ms']:.2f} ms, "
        f"c = {costs['c']:.3f}{where}",
        "v(γ) = " + ", ".join(f"{g}: {v:.2f}" for g, v in costs["v"].items()) + where,
    ]


def _trees(row: dict[str, Any]) -> str:
    """How many of a contender's steps drafted trees, and their nodes per step."""
    steps = row.get("tree_steps")
    if not steps:
        return ""
    return f" | trees: {steps} steps, {row['tree_nodes'] / steps:.1f} nodes each"


def _mode_lines(name: str, mode: dict[str, Any]) -> list[str]:
    """One mode: the field, the γ that gamma="auto" chose, the sweep and the batch row."""
    title = name if mode["label"] == name else f"{name} ({mode['label']})"
    lines = [
        "",
        f"== {title} ==",
        f"{'contender':<24}{'γ':>5}{'tok/s':>7}{'[p25-p75]':>13}{'×plain':>7}{'×γ0':>6}{'×asst':>6}"
        f"{'×a-def':>7}"
        f"{'acc':>5}{'α':>5}{'tok/pass':>9}{'pred':>5}{'pred(v)':>8}{'eff':>5}{'mism':>6}",
    ]
    lines += [_contender_line(cname, row) for cname, row in mode["contenders"].items()]
    autos = {c: r for c, r in mode["contenders"].items() if r["schedule"] == "auto"}
    if autos:
        lines += ["", "γ chosen by gamma=auto (steps by γ; a tree step counts at its depth):"]
        lines += [f"  {c:<22} {_histogram(r['gamma_histogram'])}{_trees(r)}" for c, r in autos.items()]
    lines += ["", "sweep (hfspec, fixed γ):  γ  tok/s  ×plain   ×γ0  acc     α  pred(v)  eff"]
    for s in mode["sweep"]:
        lines.append(
            f"{'':26}{s['gamma']:>2}{s['tokens_per_second']:>7.1f}{_fmt(s['speedup_vs_plain']):>8}"
            f"{_fmt(s.get('speedup_vs_hfspec_g0')):>6}"
            f"{_fmt(s['acceptance_rate']):>6}{_fmt(s['alpha']):>6}{_fmt(s['predicted_speedup_v']):>9}"
            f"{_fmt(s['efficiency']):>6}"
        )
    lines += _mismatch_lines(mode, "sweep")
    lines += _tree_lines(mode)
    if "batch" in mode:
        lines += _batch_lines(mode["batch"])
    return lines


def _tree_lines(mode: dict[str, Any]) -> list[str]:
    """The tree sweep: a fixed node budget per step, its speed, tokens per pass and acceptance by depth."""
    if not mode.get("tree_sweep"):
        return []
    lines = ["", "tree sweep (hfspec, fixed node budget):  nodes  tok/s  ×plain   ×γ0  tok/pass  acceptance by depth"]
    for t in mode["tree_sweep"]:
        depths = " ".join(f"{a:.2f}" for a in t["acceptance_by_depth"])
        lines.append(
            f"{'':40}{t['nodes']:>5}{_fmt(t['tokens_per_second'], '.1f'):>7}{_fmt(t['speedup_vs_plain']):>8}"
            f"{_fmt(t['speedup_vs_hfspec_g0']):>6}{_fmt(t['tokens_per_pass']):>10}  {depths}"
        )
    return lines + _mismatch_lines(mode, "tree")


def _mismatch_lines(mode: dict[str, Any], part: str) -> list[str]:
    """Greedy mismatches of the sweep or tree sweep (``part``): against plain (torch's kernels) and, where the
    target runs hfspec's, against plain-kernel (the reference that holds bit for bit)."""
    lines = []
    for suffix, against in (("", ""), ("_vs_kernel", " against plain-kernel")):
        if f"{part}_mismatches{suffix}" in mode:
            bad = {k: len(v) for k, v in mode[f"{part}_mismatches{suffix}"].items() if v}
            lines.append(f"{'sweep' if part == 'sweep' else 'tree sweep'} greedy mismatches{against}: {bad or 'none'}")
    return lines


def _contender_line(name: str, row: dict[str, Any]) -> str:
    tps = row["tokens_per_second"]
    g = row["gamma"] if row["gamma"] is not None else (f"~{row['mean_gamma']:.1f}" if row["mean_gamma"] else "-")
    mism = row.get("greedy_mismatches")
    mism = "-" if mism is None else str(len(mism))
    if "greedy_mismatches_vs_kernel" in row:  # against plain, then against plain-kernel
        mism += f"/{len(row['greedy_mismatches_vs_kernel'])}"
    iqr = f"[{tps['p25']:.1f}-{tps['p75']:.1f}]"
    return (
        f"{name:<24}{g!s:>5}{tps['median']:>7.1f}{iqr:>13}"
        f"{_fmt(row['speedup_vs_plain']):>7}{_fmt(row.get('speedup_vs_hfspec_g0')):>6}"
        f"{_fmt(row['speedup_vs_assisted']):>6}"
        f"{_fmt(row['speedup_vs_assisted_default']):>7}"
        f"{_fmt(row['acceptance_rate']):>5}{_fmt(row['alpha']):>5}{_fmt(row['mean_accepted_length']):>9}"
        f"{_fmt(row['predicted_speedup']):>5}{_fmt(row['predicted_speedup_v']):>8}"
        f"{_fmt(row['efficiency']):>5}{mism:>6}"
    )


def _batch_lines(b: dict[str, Any]) -> list[str]:
    t = b["tokens_per_second"]
    lines = [
        "",
        f"batch of {b['batch_size']} (γ {b['gamma']}): plain batched {t['plain_batched']:.1f} tok/s, "
        f"hfspec batched {t['hfspec_batched']:.1f}, hfspec one at a time {t['hfspec_serial']:.1f}",
        f"  hfspec batched ÷ one at a time {b['batched_vs_serial']:.2f}, "
        f"÷ plain batched {b['batched_vs_plain_batched']:.2f}; "
        f"one at a time ÷ plain batched {b['serial_vs_plain_batched']:.2f}",
    ]
    if "greedy_mismatches" in b:
        lines.append(f"  greedy rows differing from plain batched: {len(b['greedy_mismatches'])}")
    return lines


def _rollback_lines(rollback: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "recurrent target: what the rollback costs (in single-token target forwards)",
        f"{'γ':>3} {'mechanism':<10}{'v(γ)':>6}{'snap':>6}{'worst':>7}   per mode: α, v with rollback, "
        "predicted speed-up without → with",
    ]
    for g, r in rollback.items():
        per_mode = "; ".join(
            f"{m}: α {x['alpha']:.2f}, v {x['v_with_rollback']:.2f}, "
            f"{x['predicted_speedup']:.2f} → {x['predicted_speedup_with_rollback']:.2f}"
            for m, x in r["modes"].items()
        )
        lines.append(f"{g:>3} {r['mechanism']:<10}{r['v']:>6.2f}{r['snapshot']:>6.2f}{r['v_worst']:>7.2f}   {per_mode}")
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """Speed-up vs γ (measured and predicted) and acceptance by draft position, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (name, mode), color in zip(result["modes"].items(), ("tab:blue", "tab:orange", "tab:green")):
        gs = [s["gamma"] for s in mode["sweep"]]
        left.plot(
            gs, [s["speedup_vs_plain"] for s in mode["sweep"]], "o-", color=color, label=f"hfspec, {mode['label']}"
        )
        left.plot(
            gs,
            [s["predicted_speedup_v"] or float("nan") for s in mode["sweep"]],
            "--",
            color=color,
            alpha=0.6,
            label=f"predicted with v(γ), {name}",
        )
        assisted = mode["contenders"].get("assisted")  # absent when skipped or when transformers cannot assist
        if assisted and assisted["speedup_vs_plain"]:
            left.plot(
                [assisted["gamma"]],
                [assisted["speedup_vs_plain"]],
                "x",
                color=color,
                markersize=9,
                label=f"transformers assisted, {name}",
            )
        if mode["sweep"]:  # empty when --skip hfspec took the sweep's only γ
            widest = max(mode["sweep"], key=lambda s: len(s["acceptance_by_position"]))
            by_pos = widest["acceptance_by_position"]
            right.plot(range(1, len(by_pos) + 1), by_pos, "o-", color=color, label=f"γ={widest['gamma']}, {name}")
        if mode.get("tree_sweep"):  # the largest tree's steps: of those that reached depth d - 1, the share kept d
            largest = max(mode["tree_sweep"], key=lambda t: t["nodes"])
            by_depth = largest["acceptance_by_depth"]
            right.plot(
                range(1, len(by_depth) + 1),
                by_depth,
                "s--",
                color=color,
                label=f"tree of {largest['nodes']} (by depth), {name}",
            )
    left.set_xticks(sorted({s["gamma"] for mode in result["modes"].values() for s in mode["sweep"]}))
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set(xlabel="γ (drafts per step)", ylabel="speed-up vs target generate()", title="Speed-up vs γ")
    right.set(
        xlabel="draft position (trees: depth)",
        ylabel="acceptance rate",
        ylim=(0, 1.02),
        title="Acceptance by draft position",
    )
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:  # a panel left empty by --skip gets no legend (and no warning)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
