"""What a speculative generation call did: counts, rates and where the time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class RowStats:
    """One prompt's share. ``committed == accepted + target_passes`` always holds."""

    committed: int  # new tokens in the output
    accepted: int  # drafts that were accepted and kept
    target_passes: int  # verification passes this row took part in
    drafted: int  # draft tokens proposed for this row
    stop_reason: str  # "eos", "length" or "context"

    @property
    def mean_accepted_length(self) -> float:
        return self.committed / self.target_passes if self.target_passes else 0.0


@dataclass(frozen=True)
class Stats:
    """Batch totals plus per-row figures.

    ``mean_accepted_length`` is defined as vLLM does: tokens committed per target
    verification pass (1 + the accepted drafts per pass), averaged over rows' passes.
    A tree step counts its real nodes as drafted and its depth as its γ; the accepted
    drafts are the accepted path.
    """

    target_passes: int  # batched target verification forwards (prefill excluded)
    draft_passes: int  # batched draft forwards (prefill excluded)
    drafted: int
    accepted: int
    committed: int
    accepted_by_position: tuple[int, ...]  # accepts at draft position i (verification counts)
    drafted_by_position: tuple[int, ...]
    gamma_histogram: tuple[int, ...]  # steps by γ, the width of their proposal (0: a plain step)
    time_draft: float  # seconds in draft forwards (prefill included) and draft sampling
    time_target: float  # seconds in target forwards (prefill included) and verification
    time_total: float
    rows: tuple[RowStats, ...] = field(default_factory=tuple)
    tree_nodes: int = 0  # tree nodes verified (real ones, all rows), 0 for chains
    depth_histogram: tuple[int, ...] = ()  # rows' tree steps by the depth they accepted

    @classmethod
    def combine(cls, parts: list[Stats]) -> Stats:
        """Totals over several calls (say, the batches of one job): counts and times add, rows concatenate."""

        def add(vectors: list[tuple[int, ...]]) -> tuple[int, ...]:
            width = max((len(v) for v in vectors), default=0)
            return tuple(sum(v[i] for v in vectors if i < len(v)) for i in range(width))

        return cls(
            target_passes=sum(s.target_passes for s in parts),
            draft_passes=sum(s.draft_passes for s in parts),
            drafted=sum(s.drafted for s in parts),
            accepted=sum(s.accepted for s in parts),
            committed=sum(s.committed for s in parts),
            accepted_by_position=add([s.accepted_by_position for s in parts]),
            drafted_by_position=add([s.drafted_by_position for s in parts]),
            gamma_histogram=add([s.gamma_histogram for s in parts]),
            time_draft=sum(s.time_draft for s in parts),
            time_target=sum(s.time_target for s in parts),
            time_total=sum(s.time_total for s in parts),
            rows=tuple(r for s in parts for r in s.rows),
            tree_nodes=sum(s.tree_nodes for s in parts),
            depth_histogram=add([s.depth_histogram for s in parts]),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        passes = sum(r.target_passes for r in self.rows)
        return self.committed / passes if passes else 0.0

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position))

    @property
    def mean_gamma(self) -> float:
        """γ per step, averaged over steps (plain steps count as 0)."""
        steps = sum(self.gamma_histogram)
        return sum(g * n for g, n in enumerate(self.gamma_histogram)) / steps if steps else 0.0

    @property
    def time_overhead(self) -> float:
        return max(0.0, self.time_total - self.time_draft - self.time_target)

    @property
    def tokens_per_second(self) -> float:
        return self.committed / self.time_total if self.time_total > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rows"] = [dict(asdict(r), mean_accepted_length=r.mean_accepted_length) for r in self.rows]
        for name in (
            "acceptance_rate",
            "mean_accepted_length",
            "acceptance_by_position",
            "mean_gamma",
            "time_overhead",
            "tokens_per_second",
        ):
            d[name] = getattr(self, name)
        return d


class StatsCollector:
    """Counts and times of one generate call while it runs; ``result`` freezes them into ``Stats``.

    Per-row counts are kept by prompt (the call's batch order), so rows leaving the batch keep theirs.
    """

    def __init__(self, batch: int):
        self.per_row = torch.zeros(batch, 3, dtype=torch.long)  # accepted, target passes, drafted
        self.accepted_by_position: list[int] = []
        self.drafted_by_position: list[int] = []
        self.gamma_histogram: list[int] = []  # steps by the width of their proposal
        self.target_passes = self.draft_passes = 0
        self.time_draft = self.time_target = 0.0
        self.tree_nodes = 0
        self.depth_histogram: list[int] = []

    def record(
        self,
        rows: torch.Tensor,
        gamma: int,
        drafted: torch.Tensor,
        accepted: torch.Tensor,
        committed: torch.Tensor,
        draft_forwards: int,
        seconds: tuple[float, float],
    ) -> None:
        """One step over the active ``rows`` (B,), the prompts they are: a proposal ``gamma`` wide with
        ``drafted`` (B,) drafts per row, ``accepted`` (B,) of them verified, ``committed`` (B,) tokens kept
        (cut at budgets and EOS); ``seconds`` of drafting and of verification."""
        self.target_passes += 1
        self.draft_passes += draft_forwards
        self.time_draft += seconds[0]
        self.time_target += seconds[1]
        _grow(self.gamma_histogram, gamma + 1)
        self.gamma_histogram[gamma] += 1
        self.per_row[rows.cpu()] += torch.stack([committed - 1, torch.ones_like(committed), drafted], dim=1).cpu()
        positions = torch.arange(gamma, device=accepted.device)
        accepted_at = (accepted[:, None] > positions).sum(0).tolist()
        drafted_at = (drafted[:, None] > positions).sum(0).tolist()
        _grow(self.accepted_by_position, gamma)
        _grow(self.drafted_by_position, gamma)
        for i in range(gamma):
            self.accepted_by_position[i] += accepted_at[i]
            self.drafted_by_position[i] += drafted_at[i]

    def record_tree(self, nodes: torch.Tensor, depth: torch.Tensor) -> None:
        """A tree step: ``nodes`` (B,) verified per row, ``depth`` (B,) of them accepted, a path."""
        self.tree_nodes += int(nodes.sum())
        counts = torch.bincount(depth.cpu()).tolist()
        _grow(self.depth_histogram, len(counts))
        for d, n in enumerate(counts):
            self.depth_histogram[d] += n

    def result(self, outputs: list[tuple[int, str]], time_total: float) -> Stats:
        """``Stats`` of the call whose prompt b committed ``outputs[b][0]`` new tokens and stopped for
        ``outputs[b][1]``."""
        rows = tuple(RowStats(committed, *self.per_row[b].tolist(), why) for b, (committed, why) in enumerate(outputs))
        return Stats(
            target_passes=self.target_passes,
            draft_passes=self.draft_passes,
            drafted=sum(r.drafted for r in rows),
            accepted=sum(r.accepted for r in rows),
            committed=sum(r.committed for r in rows),
            accepted_by_position=tuple(self.accepted_by_position),
            drafted_by_position=tuple(self.drafted_by_position),
            gamma_histogram=tuple(self.gamma_histogram),
            time_draft=self.time_draft,
            time_target=self.time_target,
            time_total=time_total,
            rows=rows,
            tree_nodes=self.tree_nodes,
            depth_histogram=tuple(self.depth_histogram),
        )


def _grow(counts: list[int], size: int) -> None:
    """Extend ``counts`` with zeros to at least ``size`` entries."""
    counts.extend([0] * (size - len(counts)))
