"""What a step costs on the machine at hand: measured once per generator, refined by real steps.

A speculative step drafts γ tokens and verifies them in one target forward over γ+1
tokens. On a GPU that forward costs about as much as a single-token one; on a CPU it
does not, and by how much depends on the machine (a 49k-row output layer that is
repacked at every small-batch GEMM call makes 4 rows cost 2× a single row on one CPU
and 1.3× on another). So nothing here is a constant: the target's forward over 1..K+1
new tokens and one drafting step are timed where hfspec runs, after a filled cache,
and every real step then refines the table with what it actually took, sampling and
bookkeeping included.

A recurrent cache (Mamba, hybrids) adds its own cost to a verification: a snapshot
before it and a replay after a rejection (``hfspec.models.recurrent``). ``rollback_cost``
prices that in the same unit, one single-token target forward, so that it can be read
as a change of v(γ). Every time here is taken with ``hfspec.measure.timing``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hfspec.measure.timing import Stopwatch, now, timed
from hfspec.models.adapter import forward
from hfspec.models.kv_cache import KVState

# Weight of a new observation in the running averages of real step times.
_EMA = 0.2
# How far one slow observation may pull a running average up: a step slowed by something else (a collection, a page
# fault, a kernel shape timed on first use, another process) is taken as at most this factor of the average, so that
# one spike cannot make a kind of step look dear for as long as that kind is not taken again. A fast observation is
# taken as it is: nothing makes a step faster than it can be, and a measurement taken under load must heal.
_CLIP = 1.5


def _blend(old: float, seconds: float) -> float:
    """The running average ``old`` after one more observation ``seconds`` (at most ``_CLIP`` times ``old``)."""
    if old > 0:
        seconds = min(seconds, old * _CLIP)
    return (1 - _EMA) * old + _EMA * seconds


@torch.inference_mode()
def forward_seconds(
    model: Any,
    context: Sequence[int],
    sizes: Sequence[int],
    repeats: int,
    device: torch.device,
    all_logits: bool = True,
) -> dict[int, float]:
    """Median seconds of one forward over k new tokens after a cached ``context``, for each k in ``sizes``,
    :func:`capped`.

    The sizes take their turns round-robin after two warm-up forwards (the smallest
    and the largest size), so a drift of the machine hits them alike; the cache is
    rolled back after every forward.
    """
    ids = torch.tensor([list(context)], device=device)
    kv = KVState(1, device, model)
    forward(
        model,
        ids,
        kv.extend_mask(torch.ones_like(ids)),
        torch.arange(ids.shape[1], device=device)[None],
        kv.cache,
        logits_to_keep=1,
    )
    start = kv.length
    times: dict[int, list[float]] = {k: [] for k in sizes}
    warmup = [(False, min(sizes)), (False, max(sizes))]
    for measured, k in warmup + [(True, k) for _ in range(repeats) for k in sizes]:
        feed = ids[:, -k:] if ids.shape[1] >= k else ids[:, :1].repeat(1, k)
        positions = torch.arange(start, start + k, device=device)[None]
        kv.snapshot()
        _, seconds = timed(
            lambda: forward(
                model,
                feed,
                kv.extend_mask(torch.ones_like(feed)),
                positions,
                kv.cache,
                logits_to_keep=0 if all_logits else 1,
            ),
            device,
        )
        if measured:
            times[k].append(seconds)
        kv.keep(torch.zeros(1, dtype=torch.long, device=device), start, feed)
    return capped({k: statistics.median(t) for k, t in times.items()})


def capped(verify: dict[int, float]) -> dict[int, float]:
    """Each size's forward at most what it could run as: the forwards over two smaller sizes that add up to it (a
    forward over k new tokens can always run as two in a row), or one over a larger size (padded). A size measured
    dearer than that was slowed by the machine (load, a neighbour), not by its work; left as measured, it would
    price its γ out for good, since only the γ a policy takes are timed again."""
    out = dict(sorted(verify.items()))
    changed = True
    while changed:
        changed = False
        for k in out:
            bound = min(
                [out[a] + out[k - a] for a in out if a < k and k - a in out] + [out[m] for m in out if m > k],
                default=math.inf,
            )
            if bound < out[k]:
                out[k], changed = bound, True
    return out


@dataclass
class Costs:
    """Seconds per target forward over k new tokens and per drafting step, by batch size.

    ``verify[k]`` and ``draft`` are the measurements (batch 1); real steps add running
    averages per (batch, k) that take precedence. A (batch, k) never seen is priced as
    batch·k token rows (``rows``), scaled by what the nearest observation cost relative
    to its own price; a drafting step over a batch never seen, as the nearest observed
    batch's scaled by the same row curve.

    A step is priced by what it drafts (``step_seconds``): a drafter that can also look
    its drafts up in the text (``hfspec.drafters.hybrid``) pays the draft model's step
    only in steps that run the model, and a lookup that costs (almost) nothing, learnt
    from the steps that ran only the lookup, in every drafting step.
    """

    verify: dict[int, float]
    draft: float
    seconds_measuring: float = 0.0
    observed_verify: dict[tuple[int, int], float] = field(default_factory=dict)
    observed_draft: dict[int, float] = field(default_factory=dict)
    observed_lookup: dict[int, float] = field(default_factory=dict)
    observed_tree_draft: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch, nodes): seconds
    # The draft model's catch-up: what its first step after plain steps took beyond its own drafting, by batch.
    observed_catch_up: dict[int, float] = field(default_factory=dict)

    @property
    def max_gamma(self) -> int:
        """The largest γ whose verification (γ+1 tokens) and every smaller one's were measured; tree sizes
        measured beyond (``measure(..., extra=...)``) do not count."""
        k = 1
        while k + 1 in self.verify:
            k += 1
        return k - 1

    def tree_draft_seconds(self, batch: int, nodes: int, depth: int) -> float:
        """Seconds of drafting a tree of ``nodes`` at most ``depth`` levels deep: one draft forward per level
        (over the level's frontier, priced as a chain's step) until real tree steps have been timed."""
        return self.observed_tree_draft.get((batch, nodes), depth * self.draft_seconds(batch))

    def record_tree_draft(self, batch: int, nodes: int, seconds: float) -> None:
        old = self.observed_tree_draft.get((batch, nodes), seconds)
        self.observed_tree_draft[(batch, nodes)] = _blend(old, seconds)

    def measured(self, k: int) -> float:
        """The measured forward over k new tokens (batch 1); between measured sizes (a tree's, which skip
        some) interpolated linearly, beyond the largest that one's."""
        if k in self.verify:
            return self.verify[k]
        below = [m for m in self.verify if m < k]
        above = [m for m in self.verify if m > k]
        if not above or not below:
            return self.verify[max(below)] if below else self.verify[min(above)]
        lo, hi = max(below), min(above)
        return self.verify[lo] + (self.verify[hi] - self.verify[lo]) * (k - lo) / (hi - lo)

    def rows(self, rows: int) -> float:
        """A forward over ``rows`` token rows never timed as such (``batch`` rows of k tokens): priced as one row
        of that many new tokens, since the linears read the same weights once for all of them (between sizes
        measured, interpolated: the chain's, a tree's, a server's batches); past the largest size measured,
        extrapolated along the slope of the two largest, so that a large batch's verification of γ+1 tokens per
        row is priced as the work it is, not as one row's."""
        top = max(self.verify)
        if rows <= top:
            return self.measured(rows)
        below = max((k for k in self.verify if k < top), default=None)
        slope = (self.verify[top] - self.verify[below]) / (top - below) if below is not None else 0.0
        return self.verify[top] + max(0.0, slope) * (rows - top)

    def verify_seconds(self, batch: int, k: int) -> float:
        if (batch, k) in self.observed_verify:
            return self.observed_verify[(batch, k)]
        base = self.rows(batch * k)
        seen = [(b, kk) for b, kk in self.observed_verify if b == batch] or list(self.observed_verify)
        if not seen:
            return base
        # Scale by the observed/priced ratio of the closest observation (same batch first).
        b, kk = min(seen, key=lambda key: (abs(key[0] - batch), abs(key[1] - k)))
        return base * self.observed_verify[(b, kk)] / self.rows(b * kk)

    def draft_seconds(self, batch: int) -> float:
        """Seconds of one drafting step over ``batch`` rows: observed, or for a batch never seen, the nearest
        observed batch's (the measured single row's where none is) scaled as the target's forward scales with its
        rows (:meth:`rows`): the draft runs the same kernels on the same row counts, so a batch of 16 drafts is not
        priced as one row's."""
        found = self.observed_draft.get(batch)
        if found is not None:
            return found
        near = min(self.observed_draft, key=lambda b: (abs(b - batch), b), default=None)
        seconds, rows = (self.draft, 1) if near is None else (self.observed_draft[near], near)
        return seconds * self.rows(max(batch, 1)) / self.rows(rows)

    def lookup_seconds(self, batch: int) -> float:
        """Seconds of a lookup without the draft model: nothing until a step has taken one."""
        return self.observed_lookup.get(batch, 0.0)

    def catch_up_seconds(self, batch: int) -> float:
        """Seconds the draft model spends catching up on the tokens committed while it did not run (plain
        steps, lookup-alone steps), in the first step that runs it again: nothing until such a step was timed."""
        return self.observed_catch_up.get(batch, 0.0)

    def record_catch_up(self, batch: int, seconds: float) -> None:
        old = self.observed_catch_up.get(batch, seconds)
        self.observed_catch_up[batch] = _blend(old, seconds)

    def step_seconds(
        self,
        batch: int,
        gamma: int,
        model: bool = True,
        lookup: bool = False,
        drafts: float = 1.0,
        catch_up: bool = False,
    ) -> float:
        """Expected seconds of a step of up to γ drafts per row: γ draft-model steps if ``model`` (and, with
        ``catch_up``, the model's catch-up on the steps it did not run in), one lookup if ``lookup`` (neither when
        γ = 0: a plain step calls no drafter), and a verification over γ+1 tokens with probability ``drafts``, over
        the pending token alone otherwise (no row had anything to draft)."""
        drafting = gamma * self.draft_seconds(batch) if model else 0.0
        if model and gamma and catch_up:
            drafting += self.catch_up_seconds(batch)
        if lookup and gamma:
            drafting += self.lookup_seconds(batch)
        verify = self.verify_seconds(batch, gamma + 1)
        if drafts < 1.0:
            verify = drafts * verify + (1.0 - drafts) * self.verify_seconds(batch, 1)
        return drafting + verify

    def record_verify(self, batch: int, k: int, seconds: float) -> None:
        old = self.observed_verify.get((batch, k))
        if old is None:  # the first observation may carry one-off costs: start from the prediction
            old = self.verify_seconds(batch, k)
        self.observed_verify[(batch, k)] = _blend(old, seconds)

    def record_draft(self, batch: int, seconds_per_step: float) -> None:
        old = self.draft_seconds(batch)
        self.observed_draft[batch] = _blend(old, seconds_per_step)

    def record_lookup(self, batch: int, seconds: float) -> None:
        old = self.observed_lookup.get(batch, seconds)
        self.observed_lookup[batch] = _blend(old, seconds)

    def measure_more(
        self, target: Any, context: Sequence[int], sizes: Sequence[int], device: torch.device, repeats: int = 3
    ) -> None:
        """Time the target over those of ``sizes`` new tokens not measured yet (trees asked for after the
        chain's costs), scaled by the single-token forward timed beside them so that a drift of the machine
        since the first measurement does not skew v."""
        missing = sorted(set(sizes) - set(self.verify))
        if not missing:
            return
        with Stopwatch(device) as watch:
            times = forward_seconds(target, context, [1, *missing], repeats, device)
        self.verify = capped({**self.verify, **{k: times[k] * self.verify[1] / times[1] for k in missing}})
        self.seconds_measuring += watch.seconds

    @property
    def c(self) -> float:
        """A drafting step ÷ a single-token target forward (Leviathan et al.'s c), batch 1."""
        return self.draft_seconds(1) / self.verify_seconds(1, 1)

    def v(self, gamma: int, batch: int = 1) -> float:
        """A target forward over γ+1 new tokens ÷ one over 1 token."""
        return self.verify_seconds(batch, gamma + 1) / self.verify_seconds(batch, 1)

    def fastest(self) -> Costs:
        """The fastest time seen of each single-row forward and drafting step, measured or observed in a real step:
        what a process keeps for the next one (``hfspec.measure.cost_cache``). Load on a CPU only ever slows a call down
        (``hfspec.cpu.plan`` keeps its fastest round for the same reason), so the fastest is the machine's own cost,
        and a measurement taken under load heals at the next quiet run; the running averages stay this process's."""
        verify = capped({k: min(s, self.observed_verify.get((1, k), s)) for k, s in self.verify.items()})
        return Costs(verify, min(self.draft, self.observed_draft.get(1, self.draft)))

    def to_record(self) -> dict[str, Any]:
        """The measured and the refined times, as JSON (``from_record`` reads it back): what a process keeps for
        the next one (``hfspec.measure.cost_cache``)."""
        return {
            "verify": [[k, s] for k, s in sorted(self.verify.items())],
            "draft": self.draft,
            "observed_verify": [[b, k, s] for (b, k), s in sorted(self.observed_verify.items())],
            "observed_draft": [[b, s] for b, s in sorted(self.observed_draft.items())],
            "observed_lookup": [[b, s] for b, s in sorted(self.observed_lookup.items())],
            "observed_tree_draft": [[b, n, s] for (b, n), s in sorted(self.observed_tree_draft.items())],
            "observed_catch_up": [[b, s] for b, s in sorted(self.observed_catch_up.items())],
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Costs:
        """Costs from ``to_record``'s JSON; ``ValueError`` where it is not such a record (a finite time of at
        least 0 for each entry, a timed single-token forward among the measured ones)."""

        def seconds(value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"not a time in seconds: {value!r}")
            return float(value)

        def table(rows: Any, width: int) -> dict:
            out = {}
            for row in rows:
                if len(row) != width or not all(isinstance(i, int) and i > 0 for i in row[:-1]):
                    raise ValueError(f"not a row of {width - 1} counts and a time: {row!r}")
                out[row[0] if width == 2 else tuple(row[:-1])] = seconds(row[-1])
            return out

        try:
            costs = cls(
                capped(table(record["verify"], 2)),  # capped as it is read, whatever wrote it
                seconds(record["draft"]),
                observed_verify=table(record["observed_verify"], 3),
                observed_draft=table(record["observed_draft"], 2),
                observed_lookup=table(record["observed_lookup"], 2),
                observed_tree_draft=table(record["observed_tree_draft"], 3),
                observed_catch_up=table(record.get("observed_catch_up", []), 2),  # absent from older records
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a record of costs: {err!r}") from None
        if not costs.verify.get(1):
            raise ValueError("no single-token forward among the measured costs")
        return costs

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_step_ms": 1e3 * self.verify_seconds(1, 1),
            "draft_step_ms": 1e3 * self.draft_seconds(1),
            "c": self.c,
            "v": {str(g): self.v(g) for g in range(1, self.max_gamma + 1)},
            "v_tree": {str(k - 1): self.v(k - 1) for k in sorted(self.verify) if k > self.max_gamma + 1},
            "measured_target_ms": {str(k): 1e3 * t for k, t in self.verify.items()},
            "measured_draft_ms": 1e3 * self.draft,
            "lookup_ms": 1e3 * self.lookup_seconds(1),
            "seconds_measuring": self.seconds_measuring,
        }


@dataclass(frozen=True)
class Price:
    """How a γ policy priced the step it chose, for a drafter that can take cheaper steps than its model's
    (``hfspec.drafters.hybrid``): the costs it priced them by, and whether the draft model may run in it."""

    costs: Costs
    model: bool = True


def measure(
    target: Any,
    drafter: Any,
    context: Sequence[int],
    max_gamma: int,
    device: torch.device,
    repeats: int = 3,
    extra: Sequence[int] = (),
) -> Costs:
    """Time the target over 1..max_gamma+1 new tokens (and the ``extra`` sizes: trees' nodes + 1) and one
    drafting step after ``context``."""
    with Stopwatch(device) as watch:
        sizes = sorted(set(range(1, max_gamma + 2)) | set(extra))
        verify = forward_seconds(target, context, sizes, repeats, device)
        draft = drafter.step_seconds(list(context), device)
    return Costs(verify, draft, seconds_measuring=watch.seconds)


# -- what a recurrent rollback costs --------------------------------------------------------------


@dataclass(frozen=True)
class RollbackCost:
    """What rolling a recurrent cache back adds to v(γ), in units of one single-token target forward.

    ``verify`` is v(γ) (a forward over γ+1 new tokens ÷ one over 1 token, with a filled cache);
    ``snapshot`` is paid before every verification; ``replay[k - 1]`` is the rollback after a
    rejection that keeps k of the γ+1 columns (k = 1..γ; keeping all γ+1 costs nothing).
    """

    gamma: int
    mechanism: str  # "adapter", "generic" or "crop" (attention only: nothing to replay)
    step_seconds: float
    verify: float
    snapshot: float
    replay: tuple[float, ...]

    @property
    def worst(self) -> float:
        """v(γ) of a step that rejects its last draft: snapshot, verification and the longest replay."""
        return self.verify + self.snapshot + max(self.replay, default=0.0)

    def expected(self, alpha: float) -> float:
        """Mean v(γ) with the rollback, when each draft is accepted with probability α (Leviathan et al.,
        arXiv 2211.17192): k - 1 = n drafts accepted with probability α^n (1 - α) for n < γ."""
        mean_replay = sum(alpha**n * (1 - alpha) * r for n, r in enumerate(self.replay))
        return self.verify + self.snapshot + mean_replay

    def to_dict(self) -> dict[str, Any]:
        return {
            "gamma": self.gamma,
            "mechanism": self.mechanism,
            "step_ms": 1e3 * self.step_seconds,
            "v": self.verify,
            "snapshot": self.snapshot,
            "replay": list(self.replay),
            "v_worst": self.worst,
        }


@torch.inference_mode()
def rollback_cost(
    model: Any,
    context: Sequence[int],
    gamma: int,
    repeats: int = 10,
    device: torch.device | None = None,
    adapter: bool = True,
) -> RollbackCost:
    """Measure v(γ) of ``model`` after a cached ``context``, and what snapshot and rollback add.

    Each trial fills a fresh cache with ``context`` (not timed), then times a snapshot, one
    forward over the new tokens (all logits, as a verification) and a rollback; medians over
    ``repeats`` trials after one warm-up. With the adapter, recording the mixers' inputs is part
    of the verification's time; ``adapter=False`` times the generic path instead. Pass
    ``expected(α)`` to ``hfspec.policy.predicted_speedup`` as v to see the change in the
    speed-up. For a model that can only be a draft (Mamba-1), only snapshot and replay apply.
    """
    if gamma < 1:
        raise ValueError(f"gamma must be at least 1, got {gamma}")
    if not context:
        raise ValueError("the context must hold at least one token")
    device = device or model.device
    ids = torch.tensor([list(context)], device=device)
    block = ids[:, -1:].repeat(1, gamma + 1)  # (1, γ+1): the cost does not depend on which tokens

    def trial(n: int, keep: int) -> tuple[float, float, float]:
        kv = KVState(1, device, model, adapter=adapter)
        forward(
            model,
            ids,
            kv.extend_mask(torch.ones_like(ids)),
            torch.arange(ids.shape[1], device=device)[None],
            kv.cache,
            logits_to_keep=1,
        )
        start = kv.length
        feed = block[:, :n]
        t0 = now(device)
        kv.snapshot()
        t1 = now(device)
        forward(
            model,
            feed,
            kv.extend_mask(torch.ones_like(feed)),
            torch.arange(start, start + n, device=device)[None],
            kv.cache,
        )
        t2 = now(device)
        kv.keep(torch.tensor([keep], device=device), start, feed)
        t3 = now(device)
        return t1 - t0, t2 - t1, t3 - t2

    def median(n: int, keep: int) -> tuple[float, ...]:
        runs = [trial(n, keep) for _ in range(repeats + 1)][1:]  # the first warms up allocators and kernels
        return tuple(statistics.median(r[j] for r in runs) for j in range(3))

    step = median(1, 1)[1]
    snap, full, _ = median(gamma + 1, gamma + 1)
    replay = tuple(median(gamma + 1, k)[2] / step for k in range(1, gamma + 1))
    state = KVState(1, device, model, adapter=adapter).recurrent
    mechanism = state.mechanism if state is not None else "crop"
    return RollbackCost(gamma, mechanism, step, full / step, snap / step, replay)
