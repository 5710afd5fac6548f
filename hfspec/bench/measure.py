"""Running one contender on one prompt (or one batch) and measuring it.

Every contender is timed the same way, wall time of the whole ``generate`` call with the
device synchronised on both sides, and its forward passes are counted the same way, by
hooks on the models: hfspec counts its own steps, but transformers does not, and hooks
are the one count that means the same for both. transformers' contenders run torch's own
linears (``hfspec.fast.suspended``), hfspec's whatever the pair was loaded with.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from hfspec.bench.field import MAIN, Contender, Mode
from hfspec.bench.stores import LookupStores
from hfspec.cpu import fast
from hfspec.decoding.inputs import prepare_inputs
from hfspec.decoding.stats import Stats
from hfspec.drafters.factory import draft_module
from hfspec.generator import SpeculativeGenerator
from hfspec.measure import costs
from hfspec.measure.timing import timed
from hfspec.policy import CostModelGamma, FixedGamma, GammaPolicy, HeuristicGamma


@dataclass
class Run:
    """One contender on one prompt (or one batch)."""

    tokens: list[list[int]]  # new tokens per row, up to and including EOS
    seconds: float
    target_calls: int  # forwards of the target model, prefill included
    draft_calls: int
    stats: Stats | None = None  # hfspec's own counts

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def trim(row: Sequence[int], eos: set[int], length: int | None = None) -> list[int]:
    """A row's new tokens up to its first EOS (kept), cut at ``length`` first when given."""
    row = [int(t) for t in row[:length]]
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


class CallCounter:
    """Counts forward calls of a model through a hook (the same for every contender); None counts nothing."""

    def __init__(self, model: torch.nn.Module | None):
        self.calls = 0
        self.handle = model.register_forward_hook(self._hook) if model is not None else None

    def _hook(self, *_: Any) -> None:
        self.calls += 1

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()


@contextmanager
def counting(*models: torch.nn.Module | None) -> Iterator[list[CallCounter]]:
    """One ``CallCounter`` per model, removed afterwards whatever happens."""
    counters = [CallCounter(m) for m in models]
    try:
        yield counters
    finally:
        for c in counters:
            c.close()


@contextmanager
def assistant_settings(draft: torch.nn.Module, gamma: int | None):
    """Make transformers' assisted generation draft exactly γ tokens per step; restore afterwards.

    transformers reads these from the *draft's* generation config. A threshold of
    None would be filled in with the default 0.4, which stops drafting early when
    the draft is unsure; 0 disables that stopping criterion. ``gamma=None`` leaves
    transformers' defaults in place (20 tokens, constant, threshold 0.4).
    """
    if draft is None:  # prompt lookup or another drafter: nothing to set
        yield
        return
    saved = copy.deepcopy(draft.generation_config)
    try:
        if gamma is not None:
            draft.generation_config.num_assistant_tokens = gamma
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
        yield
    finally:
        draft.generation_config = saved


class Bench:
    """A target, its draft model and other drafters, and the means to run every contender on them.

    ``drafters`` maps names to anything ``SpeculativeGenerator`` takes as a draft (built by
    ``hfspec.bench.command.load_drafters``); each gets a generator of its own, so that
    gamma="auto" measures and learns for it as a user's generator would.
    """

    def __init__(
        self,
        target: Any,
        draft: Any,
        tokenizer: Any,
        *,
        max_new_tokens: int,
        gamma: int = 4,
        seed: int = 0,
        drafters: dict[str, Any] | None = None,
        assistant: Any = None,
    ):
        self.target, self.tokenizer = target.eval(), tokenizer
        self.plain_draft = assistant  # the draft as loaded, for transformers' contenders (None: ``draft`` itself)
        self.specs = {MAIN: SpeculativeGenerator(target, draft, tokenizer)}
        self.specs.update({name: SpeculativeGenerator(target, d, tokenizer) for name, d in (drafters or {}).items()})
        self.spec = self.specs[MAIN]
        self.draft = self.spec.draft  # the draft model, None for other drafters
        self.stores = LookupStores(self.specs)  # what n-gram lookup may draft from: outputs of other prompts
        self.max_new_tokens = max_new_tokens
        self.gamma = gamma  # where the heuristic schedule starts, as transformers' does
        self.seed = seed
        conf = target.generation_config
        eos = conf.eos_token_id if conf.eos_token_id is not None else tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = conf.pad_token_id if conf.pad_token_id is not None else tokenizer.pad_token_id
        self.pad = int(pad if pad is not None else min(self.eos, default=0))
        self.device = target.get_output_embeddings().weight.device
        self.cost: float = 1.0
        self.verify_cost: dict[int, float] = {}
        self._assistants: dict[str, Any] = {}

    def assistant(self, name: str) -> Any:
        """The draft model that transformers' assisted generation runs for drafter ``name``: for the main one, the
        draft as loaded (``assistant``) where hfspec runs a copy in integer arithmetic.

        With another tokenizer, transformers' universal assisted sampling prunes the assistant's LM head and
        maps its embeddings in place, for good: it gets a copy of its own, so hfspec's draft stays whole.
        """
        spec = self.specs[name]
        if name == MAIN and self.plain_draft is not None:
            return self.plain_draft
        if spec.drafter.draft_tokenizer is None or spec.draft is None:
            return spec.draft
        if name not in self._assistants:
            self._assistants[name] = copy.deepcopy(spec.draft)
        return self._assistants[name]

    def batch(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask, as transformers expects for decoder-only batches."""
        ids, mask = prepare_inputs([list(r) for r in rows], None, None, self.spec.vocab_size, None, self.max_new_tokens)
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, self.pad))
        return ids.to(self.device), mask.to(self.device)

    def policy(self, contender: Contender) -> GammaPolicy | str:
        """A fresh γ policy per call: policies keep state (``"auto"`` keeps it on the generator)."""
        if contender.schedule == "auto":
            return "auto"
        if contender.schedule == "heuristic":
            return HeuristicGamma(value=self.gamma)
        if contender.schedule == "cost-model":
            return CostModelGamma(self.cost, dict(self.verify_cost), maximum=max(self.verify_cost, default=8))
        if contender.schedule == "tree":  # generate(tree=N) drafts the tree's depth: γ is unused
            return FixedGamma(1)
        return FixedGamma(int(contender.gamma))

    def run(
        self, contender: Contender, rows: Sequence[Sequence[int]], mode: Mode, seed: int, serial: bool = False
    ) -> Run:
        """Generate for ``rows`` (one batch, or one at a time with ``serial``) and time it.

        Only the ``generate`` calls are timed, each through ``hfspec.measure.timing.timed``; forwards of the
        target and of the drafter's model are counted by hooks. Before each hfspec call, untimed,
        the drafter's lookup store is rebuilt without the outputs of ``rows`` (``hfspec.bench.stores``).
        """
        hfspec = contender.kind == "hfspec"
        parts = [[row] for row in rows] if serial else [list(rows)]
        tokens: list[list[int]] = []
        seconds, stats = 0.0, None
        draft_model = self.specs[contender.drafter].draft
        # transformers' contenders are the users' baseline: torch's own linears, whatever hfspec runs on (but the
        # target's own generate() on hfspec's kernels, the reference greedy hfspec equals bit for bit).
        kernels = contextlib.nullcontext() if hfspec or contender.kernels else fast.suspended(*self.models())
        with kernels, counting(self.target, draft_model) as (on_target, on_draft), torch.inference_mode():
            for i, part in enumerate(parts):
                if hfspec:
                    self.stores.prepare(contender.drafter, rows)
                (new, stats), took = timed(partial(self._generate, contender, part, mode, seed + i), self.device)
                tokens += new
                seconds += took
        if hfspec:
            self.stores.record(contender.drafter, rows, tokens)
        return Run(tokens, seconds, on_target.calls, on_draft.calls, None if serial else stats)

    def _generate(
        self, contender: Contender, rows: Sequence[Sequence[int]], mode: Mode, seed: int
    ) -> tuple[list[list[int]], Stats | None]:
        """New tokens per row (trimmed after EOS) and hfspec's counts (None for transformers)."""
        ids, mask = self.batch(rows)
        n = self.max_new_tokens
        if contender.kind == "hfspec":
            generator = torch.Generator(device=self.device).manual_seed(seed) if mode.do_sample else None
            out = self.specs[contender.drafter].generate(
                ids,
                mask,
                max_new_tokens=n,
                gamma=self.policy(contender),
                generator=generator,
                pad_token_id=self.pad,
                tree=contender.tree or "auto",
                **mode.kwargs(),
            )
            new = out.sequences[:, out.prompt_length :].tolist()
            return [trim(t, self.eos, r.committed) for t, r in zip(new, out.stats.rows)], out.stats
        # transformers samples from torch's global generator.
        torch.manual_seed(seed)
        extra: dict[str, Any] = {}
        assistant = self.assistant(contender.drafter) if contender.kind == "assisted" else None
        if contender.kind == "assisted":
            extra["assistant_model"] = assistant
            draft_tokenizer = self.specs[contender.drafter].drafter.draft_tokenizer
            if draft_tokenizer is not None:  # transformers pairs other tokenizers by text (universal assisted)
                extra.update(tokenizer=self.tokenizer, assistant_tokenizer=draft_tokenizer)
        elif contender.kind == "lookup":
            extra["prompt_lookup_num_tokens"] = contender.gamma
        with assistant_settings(assistant, contender.gamma):
            out = self.target.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, pad_token_id=self.pad, **mode.kwargs(), **extra
            )
        return [trim(t, self.eos) for t in out[:, ids.shape[1] :].tolist()], None

    def models(self) -> list[torch.nn.Module | None]:
        """The target and every drafter's module (model or head): what the CPU kernel may run."""
        return [self.target, self.plain_draft, *(draft_module(spec.drafter) for spec in self.specs.values())]

    def measure_costs(self, context: Sequence[int], gammas: Sequence[int], repeats: int = 20) -> dict[str, Any]:
        """c = draft step ÷ target step, v(γ) = target over γ+1 tokens ÷ target over 1, both with caches.

        Measured by ``hfspec.measure.costs.measure``, as gamma="auto" measures them, only with more
        repeats. These feed the cost-model contender and the predictions; each ``hfspec-auto``
        contender measures its own at its first call, as a user's generator does. Where a model
        runs the CPU kernel, ``eager`` holds the same figures on torch's own linears (else None).
        """
        measured = self._costs(context, gammas, repeats)
        self.cost, self.verify_cost = measured["c"], {int(g): v for g, v in measured["v"].items()}
        eager = None
        if any(m is not None and fast.is_accelerated(m) for m in self.models()):
            with fast.suspended(*self.models()):
                eager = self._costs(context, gammas, repeats)
        described = self.spec.describe()["fast_kernels"]
        return {
            **measured,
            "context_tokens": len(context),
            "repeats": repeats,
            "eager": eager,
            "fast_kernels": described,
            "step_speedup": eager["target_step_ms"] / measured["target_step_ms"] if eager else None,
        }

    def _costs(self, context: Sequence[int], gammas: Sequence[int], repeats: int) -> dict[str, Any]:
        """c, v(γ) and the step times of the main drafter's pair, as the models run now."""
        measured = costs.measure(self.target, self.spec.drafter, context, max(gammas), self.device, repeats)
        return {
            "c": measured.c,
            "v": {str(g): measured.v(g) for g in sorted(set(gammas))},
            "target_step_ms": 1e3 * measured.verify[1],
            "draft_step_ms": 1e3 * measured.draft,
            "target_ms": {str(k): 1e3 * t for k, t in measured.verify.items()},
        }

    def auto_costs(self, context: Sequence[int]) -> dict[str, Any]:
        """Each drafter's generator measures its costs as gamma="auto" does at a first call; returns them."""
        return {name: spec.measure_costs(context).to_dict() for name, spec in self.specs.items()}
