"""``hfspec bench``: hfspec against the target's own ``generate()`` and transformers' assisted generation.

Every contender runs in one process on the same prompts, interleaved per prompt
(A B C A B C …) after warm-up runs, so slow drifts of the machine hit all of them
alike. Speed-ups are medians of per-prompt ratios of tokens per second.

The cost model is Leviathan et al. (arXiv 2211.17192, Thm 3.8): with acceptance
rate α (the probability that one draft token is accepted), γ drafts per step and a
draft step costing c target steps, the expected speed-up is
(1 - α^(γ+1)) / ((1 - α)(γc + 1)). α is fitted to the measured tokens per target
pass, (1 - α^(γ+1)) / (1 - α); the share of drafts accepted is reported beside it
but is not α (it is smaller: later drafts are only reached when earlier ones pass).
Verifying γ+1 tokens is not free on every machine, so the bench also measures v(γ),
a target forward over γ+1 new tokens ÷ one over a single token, and predicts
(1 - α^(γ+1)) / ((1 - α)(γc + v(γ))).
Efficiency is the measured speed-up ÷ that prediction: what the implementation
keeps of what the cost model promises.

One job per module, top to bottom: ``field`` (modes, contenders, settings, prompts),
``measure`` (``Bench``: one timed run of one contender), ``summary`` (runs to ratios, α
and predictions), ``runner`` (the whole benchmark), ``report`` (table and plot) and
``command`` (``hfspec bench``). This face re-exports what callers use.
"""

from __future__ import annotations

from hfspec.bench.command import (
    DESCRIPTION,
    add_parser,
    apply_preset,
    configure,
    environment,
    load,
    load_drafters,
    main,
    run,
    settings_from,
    useless_copy,
    write_outputs,
)
from hfspec.bench.field import (
    DEFAULT_PROMPTS,
    GAMMA0,
    HYBRID,
    MAIN,
    USELESS,
    Contender,
    Mode,
    Settings,
    contenders,
    encode,
    load_prompts,
)
from hfspec.bench.measure import Bench, CallCounter, Run, assistant_settings, counting, trim
from hfspec.bench.report import format_table, plot
from hfspec.bench.runner import rollback_report, run_batch, run_bench
from hfspec.bench.summary import acceptance, median_ratio, mismatches, prediction, spread, summarize

__all__ = [
    "DEFAULT_PROMPTS",
    "DESCRIPTION",
    "GAMMA0",
    "HYBRID",
    "MAIN",
    "USELESS",
    "Bench",
    "CallCounter",
    "Contender",
    "Mode",
    "Run",
    "Settings",
    "acceptance",
    "add_parser",
    "apply_preset",
    "assistant_settings",
    "configure",
    "contenders",
    "counting",
    "encode",
    "environment",
    "format_table",
    "load",
    "load_drafters",
    "load_prompts",
    "main",
    "median_ratio",
    "mismatches",
    "plot",
    "prediction",
    "rollback_report",
    "run",
    "run_batch",
    "run_bench",
    "settings_from",
    "spread",
    "summarize",
    "trim",
    "useless_copy",
    "write_outputs",
]
