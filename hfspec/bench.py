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
a target forward over γ+1 new tokens ÷ one over a single token, and predicts (1 - α^(γ+1)) / ((1 - α)(γc + v(γ))).
Efficiency is the measured speed-up ÷ that prediction: what the implementation
keeps of what the cost model promises.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hfspec.costs import forward_seconds, rollback_cost
from hfspec.drafters.hybrid import HybridDrafter
from hfspec.drafters.ngram import NgramDrafter
from hfspec.errors import HfspecError
from hfspec.generator import SpeculativeGenerator
from hfspec.inputs import prepare_inputs
from hfspec.loading import load_draft, load_pair, load_preset, make_drafter
from hfspec.policy import (
    CostModelGamma, FixedGamma, GammaPolicy, HeuristicGamma, alpha_from_tokens_per_pass, predicted_speedup,
)
from hfspec.recurrent import is_recurrent
from hfspec.stats import Stats
from hfspec.timing import cpu_model, sync

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "bench.jsonl"
MAIN = "draft"  # the drafter key of the main draft
USELESS = "useless"  # random weights of the main draft's shape: a draft that cannot help

DESCRIPTION = """\
Measure one target with its draft (and other drafters) in one process. Contenders, interleaved per prompt:
  plain             the target's own generate()
  assisted          transformers assisted generation, γ drafts per step, constant schedule
  assisted-default  transformers assisted generation with its defaults (what users get)
  prompt-lookup     transformers prompt lookup (prompt_lookup_num_tokens), with --drafters ngram
  hfspec-auto       hfspec with its default settings (gamma="auto")
  hfspec            hfspec, fixed γ
  hfspec-heuristic  hfspec, γ +2 after a fully accepted step, -1 otherwise
  hfspec-cost       hfspec, γ chosen by the cost model from the bench's measured c and v(γ)
  auto:NAME         hfspec's defaults with another drafter (--drafters): 'useless' (random weights of the
                    draft's own shape: the control), 'ngram', 'hybrid' (the draft plus n-gram lookup), or a
                    path (an EAGLE-3 head or another draft model); assisted-default:useless for transformers
Reported per contender and sampling mode: tokens/s (median and quartiles over
prompts), speed-up vs plain, vs assisted at the same γ and vs assisted-default
(medians of per-prompt ratios), acceptance (acc: drafts accepted ÷ drafted; α: the
per-token rate of the cost model, fitted to tokens per target pass), tokens per
target pass, γ per step, the predicted speed-up (1-α^(γ+1))/((1-α)(γc+1)), the same
with v(γ) for the 1, and efficiency (measured ÷ predicted with v). For every hfspec
contender with gamma="auto": the costs it measured and the γ it chose, step by step
(a histogram). At greedy, every contender's tokens are checked against plain's.
Then a fixed-γ sweep (--gammas) and a batch row (--batch-size). The machine (CPU
model name, torch threads) is printed and saved with every result.
"""


# -- settings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One sampling setting, passed identically to every contender."""

    name: str  # "greedy" or "sample"
    do_sample: bool
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 turns top-k off (transformers would otherwise apply its default of 50)

    def kwargs(self) -> dict[str, Any]:
        if not self.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def label(self) -> str:
        if not self.do_sample:
            return "greedy"
        return f"T={self.temperature:g}, top-p={self.top_p:g}" + (f", top-k={self.top_k}" if self.top_k else "")


@dataclass(frozen=True)
class Contender:
    name: str  # key in the results, e.g. "hfspec" or "hfspec-g3"
    kind: str  # "plain", "assisted", "lookup" or "hfspec"
    gamma: int | None  # drafts per step; None for plain and for schedules that choose it
    schedule: str  # "-", "constant", "transformers-default", "fixed", "heuristic", "cost-model" or "auto"
    drafter: str = MAIN  # which drafter: the main draft, or a name from --drafters


def contenders(gamma: int, gammas: Sequence[int], drafters: Sequence[str] = (), assisted: bool = True,
               lookup_tokens: int | None = 10) -> tuple[list[Contender], list[Contender]]:
    """The main field and the extra fixed-γ points of the sweep (γ itself is the main ``hfspec``).

    ``assisted`` is False when transformers cannot assist with the main draft (not a model, or a
    recurrent target); ``lookup_tokens`` None leaves transformers' prompt lookup out.
    """
    main = [Contender("plain", "plain", None, "-")]
    if assisted:
        main += [Contender("assisted", "assisted", gamma, "constant"),
                 Contender("assisted-default", "assisted", None, "transformers-default")]
    if "ngram" in drafters and lookup_tokens is not None:
        main.append(Contender("prompt-lookup", "lookup", lookup_tokens, "transformers-default"))
    main += [
        Contender("hfspec-auto", "hfspec", None, "auto"),
        Contender("hfspec", "hfspec", gamma, "fixed"),
        Contender("hfspec-heuristic", "hfspec", None, "heuristic"),
        Contender("hfspec-cost", "hfspec", None, "cost-model"),
    ]
    for name in drafters:
        main.append(Contender(f"auto:{name}", "hfspec", None, "auto", drafter=name))
        if name == USELESS and assisted:
            main.append(Contender(f"assisted-default:{name}", "assisted", None, "transformers-default", drafter=name))
    sweep = [Contender(f"hfspec-g{g}", "hfspec", g, "fixed") for g in gammas if g != gamma]
    return main, sweep


# -- prompts ---------------------------------------------------------------------------------


def load_prompts(path: Path | None = None) -> list[dict[str, str]]:
    """Prompts from JSONL (objects with a ``"prompt"`` field) or plain text (one prompt per line)."""
    path = Path(path) if path is not None else DEFAULT_PROMPTS
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            obj = json.loads(line)
            if "prompt" not in obj:
                raise ValueError(f"{path}:{n}: a JSONL prompt needs a \"prompt\" field")
            prompts.append({"id": str(obj.get("id", f"line{n}")), "kind": str(obj.get("kind", "-")),
                            "prompt": str(obj["prompt"])})
        else:
            prompts.append({"id": f"line{n}", "kind": "-", "prompt": line.replace("\\n", "\n")})
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def encode(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a user turn of the chat template, or plain text without one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


# -- measuring one run -----------------------------------------------------------------------


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
    """Counts forward calls of a model through a hook (the same for every contender)."""

    def __init__(self, model: torch.nn.Module):
        self.calls = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.calls += 1

    def close(self) -> None:
        self.handle.remove()


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
    """A target, its draft model and other drafters, and the means to run every contender on them."""

    def __init__(self, target: Any, draft: Any, tokenizer: Any, *, max_new_tokens: int, gamma: int = 4,
                 seed: int = 0, drafters: dict[str, Any] | None = None):
        self.target, self.tokenizer = target.eval(), tokenizer
        self.specs = {MAIN: SpeculativeGenerator(target, draft, tokenizer)}
        self.draft = self.specs[MAIN].draft  # the draft model, None for other drafters
        self.assistants = {MAIN: self.draft}
        for name, drafter in (drafters or {}).items():
            if name == USELESS:
                drafter = self.assistants[USELESS] = useless_copy(self.draft, seed)
            self.specs[name] = SpeculativeGenerator(target, drafter, tokenizer)
        self.spec = self.specs[MAIN]
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

    def batch(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask, as transformers expects for decoder-only batches."""
        ids, mask = prepare_inputs([list(r) for r in rows], None, None, self.spec.vocab_size, None,
                                   self.max_new_tokens)
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
        return FixedGamma(int(contender.gamma))

    def run(self, contender: Contender, rows: Sequence[Sequence[int]], mode: Mode, seed: int,
            serial: bool = False) -> Run:
        """Generate for ``rows`` (one batch, or one at a time with ``serial``) and time it."""
        assistant = self.assistants.get(contender.drafter) or self.specs[contender.drafter].draft
        counters = [CallCounter(self.target)] + ([CallCounter(assistant)] if assistant is not None else [])
        try:
            with torch.inference_mode():
                sync(self.device)
                start = time.perf_counter()
                if serial:
                    parts = [self._generate(contender, [r], mode, seed + i) for i, r in enumerate(rows)]
                    tokens = [t for p, _ in parts for t in p]
                    stats = None
                else:
                    tokens, stats = self._generate(contender, rows, mode, seed)
                sync(self.device)
                seconds = time.perf_counter() - start
        finally:
            for c in counters:
                c.close()
        return Run(tokens, seconds, counters[0].calls, counters[1].calls if len(counters) > 1 else 0, stats)

    def _generate(self, contender: Contender, rows: Sequence[Sequence[int]], mode: Mode,
                  seed: int) -> tuple[list[list[int]], Stats | None]:
        ids, mask = self.batch(rows)
        n = self.max_new_tokens
        if contender.kind == "hfspec":
            generator = torch.Generator(device=self.device).manual_seed(seed) if mode.do_sample else None
            out = self.specs[contender.drafter].generate(ids, mask, max_new_tokens=n, gamma=self.policy(contender),
                                                         generator=generator, pad_token_id=self.pad, **mode.kwargs())
            new = out.sequences[:, out.prompt_length:].tolist()
            return [trim(t, self.eos, r.committed) for t, r in zip(new, out.stats.rows)], out.stats
        # transformers samples from torch's global generator.
        torch.manual_seed(seed)
        extra: dict[str, Any] = {}
        assistant = self.assistants.get(contender.drafter)
        if contender.kind == "assisted":
            extra["assistant_model"] = assistant
        elif contender.kind == "lookup":
            extra["prompt_lookup_num_tokens"] = contender.gamma
        with assistant_settings(assistant, contender.gamma if contender.kind == "assisted" else None):
            out = self.target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                       pad_token_id=self.pad, **mode.kwargs(), **extra)
        return [trim(t, self.eos) for t in out[:, ids.shape[1]:].tolist()], None

    # -- costs --------------------------------------------------------------------------------

    def measure_costs(self, context: Sequence[int], gammas: Sequence[int], repeats: int = 20) -> dict[str, Any]:
        """c = draft step ÷ target step, v(γ) = target over γ+1 tokens ÷ target over 1, both with caches.

        These feed the cost-model contender and the predictions; each ``hfspec-auto``
        contender measures its own at its first call, as a user's generator does.
        """
        t_target = forward_seconds(self.target, context, sorted({1, *(g + 1 for g in gammas)}), repeats, self.device)
        t_draft = self.spec.drafter.step_seconds(list(context), self.device)
        self.cost = t_draft / t_target[1]
        self.verify_cost = {g: t_target[g + 1] / t_target[1] for g in sorted(set(gammas))}
        return {"c": self.cost, "v": {str(g): v for g, v in self.verify_cost.items()},
                "target_step_ms": 1e3 * t_target[1], "draft_step_ms": 1e3 * t_draft,
                "target_ms": {str(k): 1e3 * t for k, t in t_target.items()}, "context_tokens": len(context),
                "repeats": repeats}

    def auto_costs(self, context: Sequence[int]) -> dict[str, Any]:
        """Each drafter's generator measures its costs as gamma="auto" does at a first call; returns them."""
        return {name: spec.measure_costs(context).to_dict() for name, spec in self.specs.items()}


def useless_copy(draft: Any, seed: int) -> Any:
    """A draft of ``draft``'s own architecture and size with random weights: it costs the same and helps nothing."""
    from transformers import AutoModelForCausalLM

    if draft is None:
        raise HfspecError("the 'useless' control needs a draft model (it copies the draft's shape)")
    torch.manual_seed(seed + 12345)
    model = AutoModelForCausalLM.from_config(draft.config).to(dtype=draft.dtype, device=draft.device)
    model.generation_config = copy.deepcopy(draft.generation_config)
    return model.eval()


# -- summaries -------------------------------------------------------------------------------


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
        return {"acceptance_rate": None, "mean_accepted_length": 1.0, "mean_gamma": 0.0,
                "acceptance_by_position": [], "gamma_histogram": []}
    histogram: list[int] = []
    if contender.kind == "hfspec":
        stats = Stats.combine([r.stats for r in runs])
        drafted, accepted, passes = stats.drafted, stats.accepted, stats.target_passes
        by_position = list(stats.acceptance_by_position)
        committed = stats.committed
        histogram = list(stats.gamma_histogram)
    else:
        passes = sum(r.target_calls for r in runs)
        committed = sum(r.new_tokens for r in runs)
        accepted = max(0, committed - passes)
        drafted = sum(r.draft_calls for r in runs) if contender.kind == "assisted" else None
        by_position = []
    return {"acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": committed / passes if passes else None,
            "mean_gamma": drafted / passes if passes and drafted is not None else None,
            "acceptance_by_position": by_position, "gamma_histogram": histogram}


def prediction(alpha: float | None, gamma: float | None, cost: float,
               verify_cost: dict[int, float]) -> tuple[float | None, float | None, int | None]:
    """Predicted speed-up with v = 1 and with the measured v(γ); adaptive runs use their mean γ, rounded."""
    if alpha is None or not gamma:
        return None, None, None
    g = max(1, round(gamma))
    v = verify_cost.get(g)
    if v is None and verify_cost:
        v = verify_cost[min(verify_cost, key=lambda k: abs(k - g))]
    return predicted_speedup(alpha, g, cost), predicted_speedup(alpha, g, cost, v or 1.0), g


def mismatches(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> list[dict[str, int]]:
    """Prompts whose tokens differ from the reference, with the first differing position."""
    found = []
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        ref, out = list(ref), list(out)
        if ref != out:
            first = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
            found.append({"prompt": i, "position": first, "reference_length": len(ref), "length": len(out)})
    return found


def summarize(contender: Contender, runs: Sequence[Run], plain: Sequence[Run], assisted: Sequence[Run] | None,
              cost: float, verify_cost: dict[int, float], greedy: bool,
              assisted_default: Sequence[Run] | None = None) -> dict[str, Any]:
    """Everything reported for one contender in one mode (``assisted*`` are None without a draft model)."""
    tps = [r.tokens_per_second for r in runs]
    acc = acceptance(contender, runs)
    vs_plain = median_ratio(tps, [r.tokens_per_second for r in plain])
    gamma = contender.gamma or acc["mean_gamma"]
    # α for the cost model, fitted at the same (rounded) γ that the prediction uses.
    alpha = (alpha_from_tokens_per_pass(acc["mean_accepted_length"], max(1, round(gamma)))
             if gamma and acc["mean_accepted_length"] else None)
    pred, pred_v, g = prediction(alpha, gamma, cost, verify_cost)
    row = {
        "kind": contender.kind, "schedule": contender.schedule, "gamma": contender.gamma,
        "drafter": contender.drafter,
        "tokens_per_second": spread(tps),
        "speedup_vs_plain": vs_plain,
        "speedup_vs_assisted": median_ratio(tps, [r.tokens_per_second for r in assisted]) if assisted else None,
        "speedup_vs_assisted_default": (median_ratio(tps, [r.tokens_per_second for r in assisted_default])
                                        if assisted_default else None),
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
        row["greedy_mismatches"] = mismatches([r.tokens[0] for r in plain], [r.tokens[0] for r in runs])
    return row


# -- the benchmark ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    gamma: int = 4
    gammas: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    modes: tuple[Mode, ...] = (Mode("greedy", False), Mode("sample", True, 0.7, 0.95, 0))
    warmup: int = 2  # passes over the field before measuring, per mode
    batch_size: int = 8  # 0 skips the batch row
    batch_repeats: int = 2
    cost_repeats: int = 20
    progress: bool = True
    lookup_tokens: int = 10  # transformers' prompt_lookup_num_tokens, for the prompt-lookup contender
    skip: tuple[str, ...] = ()  # contenders of the main field to leave out (never plain)


def run_bench(bench: Bench, prompts: Sequence[dict[str, str]], settings: Settings) -> dict[str, Any]:
    """Measure costs, then every mode: the field per prompt, the γ sweep and the batch row."""
    from tqdm.auto import tqdm

    encoded = [encode(bench.tokenizer, p["prompt"]) for p in prompts]
    gammas = tuple(sorted({*settings.gammas, settings.gamma}))
    costs = bench.measure_costs(encoded[0], range(1, max(gammas) + 1), settings.cost_repeats)
    extra = [name for name in bench.specs if name != MAIN]
    # transformers assists only a model draft, and refuses stateful (recurrent) targets.
    assists = not is_recurrent(bench.target)
    main, sweep = contenders(settings.gamma, gammas, extra, assisted=assists and bench.draft is not None,
                             lookup_tokens=settings.lookup_tokens if assists else None)
    main = [c for c in main if c.name == "plain" or c.name not in settings.skip]
    gammas = tuple(g for g in gammas if g != settings.gamma or any(c.name == "hfspec" for c in main))
    field = main + sweep
    result: dict[str, Any] = {"costs": costs, "auto_costs": bench.auto_costs(encoded[0]), "modes": {}}
    for m, mode in enumerate(settings.modes):
        seed = bench.seed + 1000 * m
        for i in tqdm(range(settings.warmup), desc=f"warm-up ({mode.name})", disable=not settings.progress,
                      file=sys.stderr):
            for c in field:
                bench.run(c, [encoded[i % len(encoded)]], mode, seed)
        runs: dict[str, list[Run]] = {c.name: [] for c in field}
        for i, ids in enumerate(tqdm(encoded, desc=f"prompts ({mode.name})", disable=not settings.progress,
                                     file=sys.stderr)):
            for c in field:  # interleaved: A B C A B C ...
                runs[c.name].append(bench.run(c, [ids], mode, seed + i))
        greedy = not mode.do_sample
        table = {c.name: summarize(c, runs[c.name], runs["plain"], runs.get("assisted"), bench.cost,
                                   bench.verify_cost, greedy, runs.get("assisted-default")) for c in field}
        by_gamma = {settings.gamma: "hfspec", **{c.gamma: c.name for c in sweep}}
        result["modes"][mode.name] = {
            "label": mode.label(), **mode.kwargs(),
            "contenders": {c.name: table[c.name] for c in main},
            "sweep": [{"gamma": g, **{k: table[by_gamma[g]][k] for k in (
                "speedup_vs_plain", "speedup_vs_assisted", "acceptance_rate", "alpha", "mean_accepted_length",
                "predicted_speedup", "predicted_speedup_v", "efficiency", "acceptance_by_position")},
                "tokens_per_second": table[by_gamma[g]]["tokens_per_second"]["median"]} for g in gammas],
            "per_prompt": [{"id": p["id"], "kind": p["kind"], "prompt_tokens": len(e),
                            **{c.name: round(runs[c.name][i].tokens_per_second, 3) for c in main}}
                           for i, (p, e) in enumerate(zip(prompts, encoded))],
        }
        if greedy:
            result["modes"][mode.name]["sweep_mismatches"] = {
                c.name: table[c.name]["greedy_mismatches"] for c in sweep}
        if settings.batch_size:
            rows = [encoded[i % len(encoded)] for i in range(settings.batch_size)]
            result["modes"][mode.name]["batch"] = run_batch(bench, rows, mode, settings, seed)
    if is_recurrent(bench.target):
        result["rollback"] = rollback_report(bench, encoded[0], gammas, result, settings.cost_repeats)
    return result


def rollback_report(bench: Bench, context: Sequence[int], gammas: Sequence[int], result: dict[str, Any],
                    repeats: int) -> dict[str, Any]:
    """What rolling a recurrent target back costs: v(γ) without and with the rollback (snapshot, and the replay
    of a rejection at the acceptance each mode measured), and the predicted speed-up either way."""
    out: dict[str, Any] = {}
    for g in gammas:
        rc = rollback_cost(bench.target, context, g, repeats=max(2, repeats // 2), device=bench.device)
        row: dict[str, Any] = {**rc.to_dict(), "modes": {}}
        for name, mode in result["modes"].items():
            alpha = mode["contenders"].get("hfspec", mode["contenders"]["hfspec-auto"])["alpha"]
            if alpha is not None:
                row["modes"][name] = {
                    "alpha": alpha, "v_with_rollback": rc.expected(alpha),
                    "predicted_speedup": predicted_speedup(alpha, g, bench.cost, rc.verify),
                    "predicted_speedup_with_rollback": predicted_speedup(alpha, g, bench.cost, rc.expected(alpha)),
                }
        out[str(g)] = row
    return out


def run_batch(bench: Bench, rows: Sequence[Sequence[int]], mode: Mode, settings: Settings,
              seed: int) -> dict[str, Any]:
    """hfspec on a whole batch vs hfspec one prompt at a time vs the target's batched ``generate()``."""
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
        "batch_size": len(rows), "repeats": settings.batch_repeats, "gamma": "auto",
        "tokens_per_second": tps,
        "batched_vs_serial": tps["hfspec_batched"] / tps["hfspec_serial"],
        "batched_vs_plain_batched": tps["hfspec_batched"] / tps["plain_batched"],
        "serial_vs_plain_batched": tps["hfspec_serial"] / tps["plain_batched"],
    }
    if not mode.do_sample:
        out["greedy_mismatches"] = mismatches(runs["plain_batched"][0].tokens, runs["hfspec_batched"][0].tokens)
    return out


# -- output ----------------------------------------------------------------------------------


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _histogram(counts: Sequence[int]) -> str:
    return " ".join(f"{g}:{n}" for g, n in enumerate(counts) if n) or "-"


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report."""
    env, costs = result.get("environment", {}), result["costs"]
    lines = []
    if env:
        lines.append(f"machine: {env.get('cpu')}, {env.get('threads')} torch threads, device {env.get('device')}, "
                     f"{env.get('dtype')}; torch {env.get('torch')}, transformers {env.get('transformers')}")
    lines += [
        f"target step {costs['target_step_ms']:.2f} ms, draft step {costs['draft_step_ms']:.2f} ms, "
        f"c = {costs['c']:.3f}",
        "v(γ) = " + ", ".join(f"{g}: {v:.2f}" for g, v in costs["v"].items()),
    ]
    for name, auto in result.get("auto_costs", {}).items():
        lines.append(f"gamma=auto, {name}: measured in {auto['seconds_measuring']:.2f} s: target step "
                     f"{auto['measured_target_ms']['1']:.2f} ms, drafting step {auto['measured_draft_ms']:.2f} ms; "
                     "v = " + ", ".join(f"{g}: {1e-3 * t / (1e-3 * auto['measured_target_ms']['1']):.2f}"
                                        for g, t in list(auto["measured_target_ms"].items())[1:]))
    for name, mode in result["modes"].items():
        title = name if mode["label"] == name else f"{name} ({mode['label']})"
        lines += ["", f"== {title} ==",
                  f"{'contender':<24}{'γ':>5}{'tok/s':>7}{'[p25-p75]':>13}{'×plain':>7}{'×asst':>6}{'×a-def':>7}"
                  f"{'acc':>5}{'α':>5}{'tok/pass':>9}{'pred':>5}{'pred(v)':>8}{'eff':>5}{'mism':>5}"]
        for cname, row in mode["contenders"].items():
            tps = row["tokens_per_second"]
            g = row["gamma"] if row["gamma"] is not None else (
                f"~{row['mean_gamma']:.1f}" if row["mean_gamma"] else "-")
            mism = row.get("greedy_mismatches")
            iqr = f"[{tps['p25']:.1f}-{tps['p75']:.1f}]"
            lines.append(
                f"{cname:<24}{g!s:>5}{tps['median']:>7.1f}{iqr:>13}"
                f"{_fmt(row['speedup_vs_plain']):>7}{_fmt(row['speedup_vs_assisted']):>6}"
                f"{_fmt(row['speedup_vs_assisted_default']):>7}"
                f"{_fmt(row['acceptance_rate']):>5}{_fmt(row['alpha']):>5}{_fmt(row['mean_accepted_length']):>9}"
                f"{_fmt(row['predicted_speedup']):>5}{_fmt(row['predicted_speedup_v']):>8}"
                f"{_fmt(row['efficiency']):>5}{'-' if mism is None else len(mism):>5}")
        autos = {c: r for c, r in mode["contenders"].items() if r["schedule"] == "auto"}
        if autos:
            lines += ["", "γ chosen by gamma=auto (steps by γ):"]
            lines += [f"  {c:<22} {_histogram(r['gamma_histogram'])}" for c, r in autos.items()]
        lines += ["", "sweep (hfspec, fixed γ):  γ  tok/s  ×plain  acc     α  pred(v)  eff"]
        for s in mode["sweep"]:
            lines.append(f"{'':26}{s['gamma']:>2}{s['tokens_per_second']:>7.1f}{_fmt(s['speedup_vs_plain']):>8}"
                         f"{_fmt(s['acceptance_rate']):>6}{_fmt(s['alpha']):>6}{_fmt(s['predicted_speedup_v']):>9}"
                         f"{_fmt(s['efficiency']):>6}")
        if "sweep_mismatches" in mode:
            bad = {k: len(v) for k, v in mode["sweep_mismatches"].items() if v}
            lines.append(f"sweep greedy mismatches: {bad or 'none'}")
        if "batch" in mode:
            b = mode["batch"]
            t = b["tokens_per_second"]
            lines += ["", f"batch of {b['batch_size']} (γ {b['gamma']}): plain batched {t['plain_batched']:.1f} tok/s, "
                          f"hfspec batched {t['hfspec_batched']:.1f}, hfspec one at a time {t['hfspec_serial']:.1f}",
                      f"  hfspec batched ÷ one at a time {b['batched_vs_serial']:.2f}, "
                      f"÷ plain batched {b['batched_vs_plain_batched']:.2f}; "
                      f"one at a time ÷ plain batched {b['serial_vs_plain_batched']:.2f}"]
            if "greedy_mismatches" in b:
                lines.append(f"  greedy rows differing from plain batched: {len(b['greedy_mismatches'])}")
    if "rollback" in result:
        lines += ["", "recurrent target: what the rollback costs (in single-token target forwards)",
                  f"{'γ':>3} {'mechanism':<10}{'v(γ)':>6}{'snap':>6}{'worst':>7}   per mode: α, v with rollback, "
                  "predicted speed-up without → with"]
        for g, r in result["rollback"].items():
            per_mode = "; ".join(f"{m}: α {x['alpha']:.2f}, v {x['v_with_rollback']:.2f}, "
                                 f"{x['predicted_speedup']:.2f} → {x['predicted_speedup_with_rollback']:.2f}"
                                 for m, x in r["modes"].items())
            lines.append(f"{g:>3} {r['mechanism']:<10}{r['v']:>6.2f}{r['snapshot']:>6.2f}{r['v_worst']:>7.2f}   "
                         f"{per_mode}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Speed-up vs γ (measured and predicted) and acceptance by draft position, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (name, mode), color in zip(result["modes"].items(), ("tab:blue", "tab:orange", "tab:green")):
        gs = [s["gamma"] for s in mode["sweep"]]
        left.plot(gs, [s["speedup_vs_plain"] for s in mode["sweep"]], "o-", color=color,
                  label=f"hfspec, {mode['label']}")
        left.plot(gs, [s["predicted_speedup_v"] or float("nan") for s in mode["sweep"]], "--", color=color,
                  alpha=0.6, label=f"predicted with v(γ), {name}")
        assisted = mode["contenders"]["assisted"]
        if assisted["speedup_vs_plain"]:
            left.plot([assisted["gamma"]], [assisted["speedup_vs_plain"]], "x", color=color, markersize=9,
                      label=f"transformers assisted, {name}")
        widest = max(mode["sweep"], key=lambda s: len(s["acceptance_by_position"]))
        by_pos = widest["acceptance_by_position"]
        right.plot(range(1, len(by_pos) + 1), by_pos, "o-", color=color, label=f"γ={widest['gamma']}, {name}")
    left.set_xticks(sorted({s["gamma"] for mode in result["modes"].values() for s in mode["sweep"]}))
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set(xlabel="γ (drafts per step)", ylabel="speed-up vs target generate()", title="Speed-up vs γ")
    left.legend(fontsize=7)
    right.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02),
              title="Acceptance by draft position")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- command line ----------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("γ values must be integers >= 1")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if len(set(names)) != len(names) or MAIN in names:
        raise argparse.ArgumentTypeError(f"drafter names must be distinct and not {MAIN!r}, got {text!r}")
    return names


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` options to ``parser``."""
    pair = parser.add_argument_group("the pair")
    pair.add_argument("--target", default="offline",
                      help="target model: a directory, a hub name, or 'offline' for the SmolLM2-135M-Instruct "
                           "built by hfspec.assets (default: offline)")
    pair.add_argument("--draft", default="shipped",
                      help="draft model: a directory, a hub name, or 'shipped' for the draft committed in the "
                           "package (default: shipped; 'shipped-eagle3' is the EAGLE-3 head committed beside it, "
                           "which --drafters takes too)")
    pair.add_argument("--drafters", type=_name_list, default=(), metavar="LIST",
                      help="more drafters as contenders, each with hfspec's default settings, comma-separated: "
                           "'useless' (random weights of the draft's own shape: the control), 'ngram' (model-free "
                           "lookup; adds transformers' prompt lookup as a baseline), 'hybrid' (the draft plus n-gram "
                           "lookup), or a directory (an EAGLE-3 head or another draft model)")
    pair.add_argument("--config", metavar="NAME",
                      help="a pair preset (a name from hfspec/configs or a JSON path): sets the target and the "
                           "draft, and the dtype and γ unless --dtype/--gamma are given")
    pair.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                      help="weights dtype for both models (default: the preset's with --config, else float32)")
    pair.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    work = parser.add_argument_group("the workload")
    work.add_argument("--prompts-file", type=Path, default=None,
                      help="prompts: JSONL with a \"prompt\" field, or plain text with one prompt per line "
                           "(default: the package's prompts/bench.jsonl); prompts go through the target's "
                           "chat template when it has one")
    work.add_argument("--num-prompts", type=int, default=12, help="use the first N prompts (default: 12)")
    work.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default: 64)")
    work.add_argument("--gamma", type=int, default=None,
                      help="γ, drafts per step, for hfspec fixed and transformers assisted "
                           "(default: the preset's with --config, else 4)")
    work.add_argument("--gammas", type=_int_list, default=(1, 2, 3, 4, 6, 8),
                      help="γ values of the hfspec fixed-γ sweep, comma-separated (default: 1,2,3,4,6,8)")
    work.add_argument("--modes", default="greedy,sample",
                      help="which of 'greedy' and 'sample' to run, comma-separated (default: both)")
    work.add_argument("--temperature", type=float, default=0.7, help="temperature of the sample mode (default: 0.7)")
    work.add_argument("--top-p", type=float, default=0.95, help="top-p of the sample mode (default: 0.95)")
    work.add_argument("--top-k", type=int, default=0,
                      help="top-k of the sample mode; 0 turns it off for every contender (default: 0)")
    work.add_argument("--seed", type=int, default=0, help="base seed of the sample mode (default: 0)")
    work.add_argument("--skip", type=_name_list, default=(), metavar="LIST",
                      help="contenders of the main field to leave out, comma-separated (e.g. "
                           "hfspec-heuristic,hfspec-cost); plain always runs")
    work.add_argument("--lookup-tokens", type=int, default=10,
                      help="prompt_lookup_num_tokens of transformers' prompt-lookup contender (default: 10)")
    work.add_argument("--batch-size", type=int, default=8,
                      help="prompts in the batch row (hfspec batched vs one at a time vs plain batched); "
                           "0 skips it (default: 8)")
    work.add_argument("--batch-repeats", type=int, default=2, help="measured repeats of the batch row (default: 2)")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--warmup", type=int, default=2,
                        help="warm-up passes over every contender before measuring, per mode (default: 2)")
    timing.add_argument("--cost-repeats", type=int, default=20,
                        help="timed forwards per measurement of c and v(γ) (default: 20)")
    timing.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                     help="write the results as JSON to PATH, or to stdout with a bare --json "
                          "(the table then goes to stderr)")
    out.add_argument("--plot", type=Path, default=None, metavar="PATH",
                     help="write a PNG: speed-up vs γ and acceptance by draft position")
    out.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``hfspec bench`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "bench", help="measure hfspec against generate() and transformers assisted generation",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    parser.set_defaults(func=run)
    return parser


def apply_preset(args: argparse.Namespace) -> None:
    """Fill --target, --draft, --dtype and --gamma from --config, unless given on the command line."""
    if not args.config:
        return
    preset = load_preset(args.config)
    args.target, args.draft = preset.target, preset.draft
    if args.dtype is None and preset.dtype != "auto":
        args.dtype = preset.dtype
    if args.gamma is None:
        args.gamma = preset.gamma


def load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(target, draft, tokenizer) through hfspec.loading, which also resolves 'offline' and 'shipped'."""
    dtype = getattr(torch, args.dtype or "float32")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return load_pair(args.target, args.draft, dtype=dtype, device=device)


def load_drafters(names: Sequence[str], target: Any, draft: Any) -> dict[str, Any]:
    """The --drafters: names to drafters (``useless`` is built by ``Bench`` from the draft itself)."""
    out: dict[str, Any] = {}
    for name in names:
        if name == USELESS:
            out[name] = None
        elif name == "hybrid":
            out[name] = HybridDrafter(make_drafter(draft), NgramDrafter())
        else:
            device = target.get_output_embeddings().weight.device
            out[name] = load_draft(name, target, dtype=target.dtype, device=device)
    return out


def settings_from(args: argparse.Namespace) -> Settings:
    modes = []
    for name in (m.strip() for m in args.modes.split(",") if m.strip()):
        if name == "greedy":
            modes.append(Mode("greedy", False))
        elif name == "sample":
            modes.append(Mode("sample", True, args.temperature, args.top_p, args.top_k))
        else:
            raise SystemExit(f"unknown mode {name!r}; use greedy, sample or greedy,sample")
    if args.gamma < 1 or args.max_new_tokens < 2 or args.num_prompts < 1:
        raise SystemExit("--gamma must be >= 1, --max-new-tokens >= 2 and --num-prompts >= 1")
    return Settings(gamma=args.gamma, gammas=tuple(args.gammas), modes=tuple(modes), warmup=args.warmup,
                    batch_size=args.batch_size, batch_repeats=max(1, args.batch_repeats),
                    cost_repeats=max(1, args.cost_repeats), progress=not args.no_progress,
                    lookup_tokens=args.lookup_tokens, skip=tuple(args.skip))


def environment(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    import transformers

    return {"command": " ".join(sys.argv), "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "device": str(bench.device), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "dtype": str(bench.target.dtype).replace("torch.", ""),
            "target": str(args.target), "draft": str(args.draft), "drafters": list(getattr(args, "drafters", ())),
            "max_new_tokens": args.max_new_tokens, "gamma": args.gamma}


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hfspec bench``; returns the exit status."""
    if args.threads:
        torch.set_num_threads(args.threads)
    apply_preset(args)
    if args.gamma is None:
        args.gamma = 4
    settings = settings_from(args)
    prompts = load_prompts(args.prompts_file)[: args.num_prompts]
    target, draft, tokenizer = load(args)
    bench = Bench(target, draft, tokenizer, max_new_tokens=args.max_new_tokens, gamma=args.gamma, seed=args.seed,
                  drafters=load_drafters(args.drafters, target, draft))
    result = {"environment": environment(args, bench), **run_bench(bench, prompts, settings),
              "prompts": [p["id"] for p in prompts]}
    write_outputs(result, args.json, args.plot)
    return 0


def write_outputs(result: dict[str, Any], json_path: str | None, plot_path: Path | None) -> None:
    table = format_table(result)
    if json_path == "-":
        print(table, file=sys.stderr)
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if plot_path:
        plot(result, Path(plot_path))


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure(argparse.ArgumentParser(prog="hfspec bench", description=DESCRIPTION,
                                               formatter_class=argparse.RawDescriptionHelpFormatter))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
