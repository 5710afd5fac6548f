"""What a training run reports: the draft's measured cost and the speedup Leviathan et al. predict from it.

Speculative decoding cares about two numbers of a draft: the acceptance rate α =
E[Σ_x min(p(x), q(x))] (p the target's distribution, q the draft's) and the cost
ratio c of one draft decode step to one target decode step. From them Leviathan et al.
(arXiv 2211.17192, eq. 1 and Theorem 3.8) predict the speedup (1 − α^(γ+1)) / ((1 − α)(γc + 1));
the math lives in :mod:`hfspec.policy`, the timing in :mod:`hfspec.measure.timing`. Every report is
written as ``distill_report.json`` in the run's ``out_dir``.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from hfspec.errors import HfspecError
from hfspec.measure.timing import timed
from hfspec.models.adapter import cache_kwarg
from hfspec.policy import best_gamma

__all__ = [
    "REPORT",
    "SpeedupForecast",
    "decode_step_seconds",
    "final_loss",
    "forecast_speedup",
    "hours",
    "speedup_at_best_gamma",
    "write_report",
]

log = logging.getLogger(__name__)

REPORT = "distill_report.json"  # the report's file name in out_dir
MAX_GAMMA = 8  # γ is chosen in 1..MAX_GAMMA


def speedup_at_best_gamma(alpha: float, cost_ratio: float, max_gamma: int = MAX_GAMMA) -> tuple[float, int]:
    """(speedup, γ): the best predicted speedup over γ in 1..max_gamma and that γ.

    :func:`hfspec.policy.best_gamma` with the paper's verification cost of one target step,
    refusing an α outside [0, 1] or a negative c, which a training report must never print.
    """
    if not 0.0 <= alpha <= 1.0:
        raise HfspecError(f"alpha must lie in [0, 1], got {alpha}")
    if cost_ratio < 0:
        raise HfspecError(f"cost_ratio must be non-negative, got {cost_ratio}")
    gamma, speedup = best_gamma(alpha, cost_ratio, maximum=max_gamma)
    return speedup, gamma


@dataclass(frozen=True)
class SpeedupForecast:
    """The predicted speedup of a draft, rounded as reports print it: sampling at T=1 and greedy."""

    cost_ratio: float  # c = draft step / target step
    speedup_sampled: float  # predicted with α at T=1, best γ
    gamma_sampled: int
    speedup_greedy: float  # predicted with α = greedy agreement, best γ
    gamma_greedy: int


def forecast_speedup(alpha: float, agreement: float, target_seconds: float, draft_seconds: float) -> SpeedupForecast:
    """The forecast for a draft with acceptance ``alpha`` at T=1 and greedy ``agreement``, from its step times.

    Greedy decoding accepts a draft exactly when it is the target's argmax, so the greedy
    agreement plays α's part there.
    """
    c = draft_seconds / target_seconds
    sp_a, g_a = speedup_at_best_gamma(alpha, c)
    sp_g, g_g = speedup_at_best_gamma(agreement, c)
    return SpeedupForecast(round(c, 4), round(sp_a, 3), g_a, round(sp_g, 3), g_g)


@torch.inference_mode()
def decode_step_seconds(
    *models: PreTrainedModel, context: int = 64, steps: int = 32, warmup: int = 8, seed: int = 0
) -> tuple[float, ...]:
    """Median wall time of one batch-1 decode step with a KV cache, after warm-up, per model.

    The models take their steps in turn, so that on a shared machine each sees the
    same background load and the ratio of their times stays fair; each step is timed
    with :func:`hfspec.measure.timing.timed`, which waits for the model's device.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(m.config.vocab_size for m in models), (1, context), generator=gen)
    decoders = [_Decoder(model, ids) for model in models]
    times: list[list[float]] = [[] for _ in models]
    for i in range(warmup + steps):
        for decoder, kept in zip(decoders, times):
            seconds = timed(decoder.step, decoder.device)[1]
            if i >= warmup:
                kept.append(seconds)
    return tuple(statistics.median(t) for t in times)


class _Decoder:
    """One model decoding greedily from a prefilled KV cache, a token per :meth:`step`."""

    def __init__(self, model: PreTrainedModel, ids: torch.Tensor):
        self.model, self.device = model, model.device
        self.cache = DynamicCache(config=model.config)
        self.key = cache_kwarg(type(model))
        self.token = self._forward(ids.to(self.device))

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=True, **{self.key: self.cache}).logits[:, -1:].argmax(-1)

    def step(self) -> None:
        self.token = self._forward(self.token)


def final_loss(losses: list[float]) -> float:
    """Mean training loss over the last 10% of steps: one step's loss is too noisy to report."""
    tail = losses[-max(1, len(losses) // 10) :]
    return round(sum(tail) / len(tail), 4)


def write_report(out: Path, report: Any, what: str) -> None:
    """Write ``report`` (a dataclass with ``to_dict()``) as ``out/distill_report.json`` and log it."""
    (out / REPORT).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    log.info("%s saved to %s: %s", what, out, report.to_dict())


def hours(seconds: float) -> str:
    """``"1.5 h"``: how model cards give the time a run took."""
    return f"{seconds / 3600:.1f} h"
