"""What the bench runs: the sampling modes, the contenders, the settings and the prompts.

Every contender of one mode gets the same sampling settings and the same prompts, so that
the only difference between two rows of the report is the way the tokens were produced.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfspec.errors import HfspecError
from hfspec.models.paths import DATA

DEFAULT_PROMPTS = DATA / "prompts" / "bench.jsonl"
MAIN = "draft"  # the drafter key of the main draft
GAMMA0 = "hfspec-g0"  # hfspec drafting nothing: the baseline on hfspec's own kernels
PLAIN_KERNEL = "plain-kernel"  # the target's own generate() on hfspec's CPU kernels: greedy hfspec's exact reference
USELESS = "useless"  # random weights of the main draft's shape: a draft that cannot help
HYBRID = "hybrid"  # the main draft plus n-gram lookup (hfspec.drafters.hybrid.with_ngram)


@dataclass(frozen=True)
class Mode:
    """One sampling setting, passed identically to every contender."""

    name: str  # "greedy" or "sample"
    do_sample: bool
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 turns top-k off (transformers would otherwise apply its default of 50)

    def kwargs(self) -> dict[str, Any]:
        """The sampling arguments of ``generate()``, the same for hfspec and transformers."""
        if not self.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def label(self) -> str:
        """How the report names this mode."""
        if not self.do_sample:
            return "greedy"
        return f"T={self.temperature:g}, top-p={self.top_p:g}" + (f", top-k={self.top_k}" if self.top_k else "")


@dataclass(frozen=True)
class Contender:
    """One way of generating: an implementation, its γ schedule and its drafter."""

    name: str  # key in the results, e.g. "hfspec" or "hfspec-g3"
    kind: str  # "plain", "assisted", "lookup" or "hfspec"
    gamma: int | None  # drafts per step; None for plain and for schedules that choose it
    schedule: str  # "-", "constant", "transformers-default", "fixed", "heuristic", "cost-model", "auto" or "tree"
    drafter: str = MAIN  # which drafter: the main draft, or a name from --drafters
    tree: int = 0  # a draft tree's node budget per step (schedule "tree"); 0 drafts chains
    kernels: bool = False  # a transformers contender run on hfspec's CPU kernels, as the loaded models are


def contenders(
    gamma: int,
    gammas: Sequence[int],
    drafters: Sequence[str] = (),
    assisted: bool = True,
    lookup_tokens: int | None = 10,
    kernels: bool = False,
) -> tuple[list[Contender], list[Contender]]:
    """The main field and the extra fixed-γ points of the sweep (γ itself is the main ``hfspec``).

    ``assisted`` is False when transformers cannot assist with the main draft (not a model, or a
    recurrent target); ``lookup_tokens`` None leaves transformers' prompt lookup out; ``kernels``: the target runs
    hfspec's CPU kernels, so its own generate() on them (``PLAIN_KERNEL``) runs too, the second reference.
    """
    # γ = 0 is the target alone in hfspec's loop: what speculation adds, measured on the same kernels.
    main = [Contender("plain", "plain", None, "-"), Contender(GAMMA0, "hfspec", 0, "fixed")]
    if kernels:
        main.insert(1, Contender(PLAIN_KERNEL, "plain", None, "-", kernels=True))
    if assisted:
        main += [
            Contender("assisted", "assisted", gamma, "constant"),
            Contender("assisted-default", "assisted", None, "transformers-default"),
        ]
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
        # The control is a plain model, so transformers can assist with it too: the same control for both.
        if name == USELESS and assisted:
            main.append(Contender(f"assisted-default:{name}", "assisted", None, "transformers-default", drafter=name))
    sweep = [Contender(f"hfspec-g{g}", "hfspec", g, "fixed") for g in gammas if g != gamma]
    return main, sweep


def tree_contenders(budgets: Sequence[int]) -> list[Contender]:
    """The tree sweep: hfspec drafting a tree of each node budget every step (``generate(tree=N)``)."""
    return [Contender(f"hfspec-t{n}", "hfspec", None, "tree", tree=n) for n in budgets]


@dataclass(frozen=True)
class Settings:
    """How much to measure and how: everything of a bench run but the models and the prompts."""

    gamma: int = 4
    gammas: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    trees: tuple[int, ...] = (8, 16, 32)  # node budgets of the tree sweep (none: no tree sweep)
    modes: tuple[Mode, ...] = (Mode("greedy", False), Mode("sample", True, 0.7, 0.95, 0))
    warmup: int = 2  # passes over the field before measuring, per mode
    batch_size: int = 8  # 0 skips the batch row
    batch_repeats: int = 2
    cost_repeats: int = 20
    progress: bool = True
    lookup_tokens: int = 10  # transformers' prompt_lookup_num_tokens, for the prompt-lookup contender
    skip: tuple[str, ...] = ()  # contenders of the main field to leave out (never plain)


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
                raise HfspecError(f'{path}:{n}: a JSONL prompt needs a "prompt" field')
            prompts.append(
                {"id": str(obj.get("id", f"line{n}")), "kind": str(obj.get("kind", "-")), "prompt": str(obj["prompt"])}
            )
        else:
            prompts.append({"id": f"line{n}", "kind": "-", "prompt": line.replace("\\n", "\n")})
    if not prompts:
        raise HfspecError(f"{path} holds no prompts")
    return prompts


def encode(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a user turn of the chat template, or plain text without one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]
