"""The optimiser, its schedule and the training loop every kind of draft shares.

AdamW with a linear warm-up and a cosine decay to 10% of the peak rate, gradient
clipping, a checkpoint at every held-out check so that a run resumes where it stopped,
and best-weights selection: a small draft trained for many epochs on fixed text
overfits it, so the weights kept are those of the best held-out check, not the last.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm

from hfspec.measure.timing import now
from hfspec.training.settings import CHECKPOINT

__all__ = ["FitSettings", "Optim", "fit", "learning_rate"]

log = logging.getLogger(__name__)


class FitSettings(Protocol):
    """What the loop reads from a run's settings; both kinds' settings dataclasses have these fields."""

    batch: int  # samples per step
    steps: int
    lr: float  # peak learning rate
    seed: int  # orders the passes over the samples
    eval_every: int  # steps between held-out checks (and checkpoints)


@dataclass(frozen=True)
class Optim:
    """AdamW settings and the gradient-norm clip of a training run."""

    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.01
    clip: float = 1.0


def learning_rate(step: int, s: FitSettings) -> float:
    """Peak ``s.lr`` after a linear warm-up (a tenth of the steps, at most 100), then cosine decay to 10%."""
    warmup = max(1, min(100, s.steps // 10))
    if step < warmup:
        return s.lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, s.steps - warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))


@dataclass
class _Run:
    """Where training stands; with the weights and the optimiser state it is the checkpoint."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0  # training wall time, all runs summed, counted up to the last check
    checks: list[tuple] = field(default_factory=list)  # (step, *row) of each held-out check
    best: tuple[int, float, dict] | None = None  # (step, score, weights) of the best check


def fit(
    model: torch.nn.Module,
    loss_of: Callable[[list[int]], torch.Tensor],
    check: Callable[[], tuple[float, tuple]],
    n_samples: int,
    train_dir: Path,
    s: FitSettings,
    *,
    optim: Optim = Optim(),
    generator: torch.Generator | None = None,
    desc: str = "training draft",
    progress: bool = True,
) -> tuple[list[float], float, list[tuple], int]:
    """Train ``model`` with AdamW, :func:`learning_rate` and clipping, checkpointing to ``train_dir``.

    Each step takes the loss of ``loss_of(sample indices)``, ``s.batch`` indices of a
    shuffled pass over ``n_samples`` (seeded by ``s.seed``). Every ``s.eval_every`` steps
    (and at the last) ``check()`` returns (score, row): the row is kept in the checks,
    and the weights with the best score are the ones left in ``model`` at the end. A
    checkpoint in ``train_dir`` resumes, with ``generator``'s state. Returns (losses,
    seconds, checks as (step, *row), best step).
    """
    train_dir.mkdir(parents=True, exist_ok=True)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    run = _resume(train_dir / CHECKPOINT, model, opt, generator, s.steps)
    batches = _batch_indices(n_samples, s.batch, s.seed, start=run.step)
    device = next(model.parameters()).device
    model.train()
    t_last = now(device)
    with tqdm(total=s.steps, initial=run.step, desc=desc, unit="step", disable=not progress) as bar:
        while run.step < s.steps:
            for group in opt.param_groups:
                group["lr"] = learning_rate(run.step, s)
            _step(model, opt, loss_of(next(batches)), optim.clip, run)
            bar.update()
            bar.set_postfix(loss=f"{run.losses[-1]:.3f}")
            if run.step % s.eval_every == 0 or run.step == s.steps:
                row = _check(model, check, run)
                bar.set_postfix(loss=f"{run.losses[-1]:.3f}", heldout=f"{row[0]:.3f}", best=run.best[0])
                t_now = now(device)
                run.seconds += t_now - t_last
                t_last = t_now
                _save(train_dir, model, opt, run, generator)
    if run.best is not None:
        model.load_state_dict(run.best[2])
    model.eval()
    return run.losses, run.seconds, run.checks, run.best[0] if run.best is not None else run.step


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, clip: float, run: _Run) -> None:
    """One optimiser step on ``loss``, recorded in ``run``."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    run.losses.append(float(loss.detach()))
    run.step += 1


def _check(model: torch.nn.Module, check: Callable[[], tuple[float, tuple]], run: _Run) -> tuple:
    """Run the held-out ``check`` in eval mode, record its row and keep the weights if they score best."""
    was_training = model.training
    model.eval()
    score, row = check()
    model.train(was_training)
    run.checks.append((run.step, *row))
    if run.best is None or score >= run.best[1]:  # on a tie, the later (longer trained) weights
        run.best = (run.step, score, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return row


def _resume(
    ckpt: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, generator: torch.Generator | None, steps: int
) -> _Run:
    """The run saved in ``ckpt``, its weights, optimiser and sampler state restored; a fresh run if none."""
    if not ckpt.is_file():
        return _Run()
    state = torch.load(ckpt, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if generator is not None:
        generator.set_state(state["sampler"])
    log.info("resuming training at step %d of %d", state["step"], steps)
    return _Run(state["step"], state["losses"], state["seconds"], state.get("checks", []), state.get("best"))


def _save(
    train_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, run: _Run, generator: torch.Generator | None
) -> None:
    """Write the checkpoint whole or not at all: a run killed while saving resumes from the one before."""
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": run.step,
        "losses": run.losses,
        "seconds": run.seconds,
        "checks": run.checks,
        "best": run.best,
    }
    if generator is not None:
        state["sampler"] = generator.get_state()
    tmp = train_dir / f"{CHECKPOINT}.tmp"
    torch.save(state, tmp)
    tmp.replace(train_dir / CHECKPOINT)


def _batch_indices(n: int, batch: int, seed: int, start: int = 0) -> Iterator[list[int]]:
    """Sample indices of each step: shuffled passes over ``n``, from step ``start`` on (a resumed run sees the same)."""
    rng = random.Random(seed)
    order: list[int] = []
    step = 0
    while True:
        if not order:
            order = list(range(n))
            rng.shuffle(order)
        chosen, order = order[:batch], order[batch:]
        if step >= start:
            yield chosen
        step += 1
