"""``SpeculativeGenerator``: a target and a drafter, loaded or given, and ``generate`` over them.

The generator checks the pair once, resolves each call's settings, γ policy and tree budget, and runs the call's
loop (``hfspec.decoding.loop.Call``: propose → verify → roll back → accept). What it learns across calls stays here:
the costs measured for ``gamma="auto"`` (kept on disk by ``hfspec.measure.cost_cache``), the acceptance seen so far,
whether the target reads draft trees exactly, and the CPU thread count the kernels were fitted to.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, PreTrainedModel, PreTrainedTokenizerBase

from hfspec.cpu import draft_linear, fast
from hfspec.cpu import threads as cpu_threads
from hfspec.decoding import config as cfg
from hfspec.decoding.inputs import prepare_inputs
from hfspec.decoding.loop import Call, GenerateOutput
from hfspec.decoding.rows import right_pad
from hfspec.decoding.stats import Stats
from hfspec.drafters import Drafter, builds_trees, cross_tokenizer
from hfspec.drafters.factory import draft_module, make_drafter
from hfspec.drafters.loading import load_pair
from hfspec.errors import HfspecError, HfspecTypeError
from hfspec.measure import cost_cache, costs
from hfspec.measure.costs import Costs
from hfspec.models import recurrent
from hfspec.models.adapter import check_causal_lm, check_tree_attention, shared_vocab_size, window_in_columns
from hfspec.models.kv_cache import KVState
from hfspec.policy import GammaPolicy, Tuning, as_policy
from hfspec.settings import SamplingParams
from hfspec.tree.probe import reads_trees

__all__ = ["AUTO_TREES", "GenerateOutput", "SpeculativeGenerator"]

log = logging.getLogger(__name__)

AUTO_TREES = (4, 6, 8, 16)  # the tree budgets tree="auto" weighs against the chain


def _one_at_a_time(generate: Callable) -> Callable:
    """``generate`` holding the generator's lock: calls from other threads wait for the running one, which then
    runs as it would alone. Its drafter's caches and its policy's learning are the running call's: the forwards
    of two calls at once would share the same cores (no faster on CPU, README "Threads"), and what the generator
    learns across calls (costs, acceptance, a lookup's earlier outputs) would depend on their interleaving. The
    running call's own thread calling it again (from a streamer or a logits processor) is refused."""

    @functools.wraps(generate)
    def one_at_a_time(self: SpeculativeGenerator, *args: Any, **kwargs: Any) -> GenerateOutput:
        with self._lock:
            if self._running:
                raise HfspecError(
                    "generate was called from inside a generate call on the same generator (a "
                    "streamer or logits processor?); build a second SpeculativeGenerator for it"
                )
            self._running = True
            try:
                return generate(self, *args, **kwargs)
            finally:
                self._running = False

    return one_at_a_time


def _in_threads(generate: Callable) -> Callable:
    """``generate`` on its ``threads=`` CPU threads, else the generator's ``threads`` (None: torch's count as it is),
    torch's count restored after the call (``hfspec.cpu.threads``). The models' kernel plans and the costs that
    ``gamma="auto"`` weighs are those of the count the call runs on: timed again where they were for another."""

    @functools.wraps(generate)
    def in_threads(self: SpeculativeGenerator, *args: Any, **kwargs: Any) -> GenerateOutput:
        threads = kwargs.get("threads")
        with cpu_threads.using(self.threads if threads is None else threads) as count:
            if count != self._threads_fitted:
                fast.replan(self.target)
                fast.replan(draft_module(self.drafter))
                if self._threads_fitted is not None:  # costs measured on another count are not this count's
                    self.tuning.costs = None
                self._threads_fitted = count
            return generate(self, *args, **kwargs)

    return in_threads


class SpeculativeGenerator:
    """Lossless speculative decoding: a ``draft`` proposes, the ``target`` causal LM verifies.

    ``draft`` is a causal LM sharing the target's tokenizer, any ``hfspec.drafters.Drafter``, a
    path (an EAGLE-3 head's directory, a causal LM), or ``"ngram"`` (model-free lookup in the
    context and in earlier outputs). ``ngram=True`` adds that lookup to a model draft or head:
    per row, whichever is expected to get more accepted. A draft model with its own tokenizer
    is passed with ``draft_tokenizer=``: where it differs from ``tokenizer``, the draft proposes
    only the tokens both share (``hfspec.drafters.cross_tokenizer``), still losslessly. ``threads``
    sets the CPU threads every ``generate`` call runs on (see there).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | Drafter | str | Path,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        ngram: bool = False,
        draft_tokenizer: PreTrainedTokenizerBase | None = None,
        threads: int | None = None,
    ):
        check_causal_lm(target, "target")
        self.threads = cpu_threads.check(threads)  # CPU threads of every call (None: torch's count as it is)
        self.target = target.eval()
        if draft_tokenizer is not None:  # a draft model with its own tokenizer: drafts across them when they differ
            draft = cross_tokenizer.adapt(draft, draft_tokenizer, tokenizer)
        self.drafter = make_drafter(draft, tokenizer, target, ngram=ngram)
        self.tokenizer = tokenizer
        self.vocab_size = shared_vocab_size(target, self.drafter.vocab_size, tokenizer)
        # Refuse, before any generation, a recurrent state that cannot be rolled back exactly.
        recurrent.check(self.target, "target")
        if self.draft is not None:
            recurrent.check(self.draft, "draft")
        self.check_invariants = True
        self.tuning = Tuning()  # gamma="auto": the costs measured here and the acceptance seen so far
        self._costs_key: dict[str, Any] | None = None  # what the costs depend on (``costs_key``)
        self._kept_record: cost_cache.Kept | None = None  # what an earlier process kept of them (``_kept``)
        self._reads_trees: bool | None = None  # whether the target reads a tree exactly (probed once)
        self._lock = threading.RLock()  # one call at a time (``_one_at_a_time``)
        self._running = False  # a call holds the lock and runs
        self._threads_fitted: int | None = None  # the thread count the kernel plans and costs were last fitted to

    def measure_costs(self, context: Sequence[int] | None = None, force: bool = False) -> Costs:
        """Time the target over 1..K+1 new tokens and one drafting step on this machine (once; ``force``
        measures again). ``context`` (token ids) fills the caches first; a stand-in is used without one."""
        with self._lock:  # timings taken while another call runs would be that call's too
            return self._measure_costs(context, force)

    def _measure_costs(self, context: Sequence[int] | None, force: bool) -> Costs:
        ids = list(context or [0])
        ids = (ids * (64 // len(ids) + 1))[-64:]  # costs depend on the cache length a little: a realistic one
        window = self._context_window()
        device = self.target.get_output_embeddings().weight.device
        measuring = self.tuning.costs is None or force
        if window is not None:  # context plus the largest verification must fit the position embeddings
            if measuring:
                self.tuning.maximum = max(1, min(self.tuning.maximum, window // 2 - 1))
            ids = ids[-(window - max((self.tuning.maximum, *self.tuning.trees)) - 1) :]
        if measuring:
            found = None if force else self._kept().costs
            if found is not None and found.max_gamma >= self.tuning.maximum:
                self.tuning.costs = found
                # The acceptance seen before too: a new process drafts from it, not from the prior (α = 0.5).
                self.tuning.remember(self._kept().acceptance)
                log.debug("costs for gamma='auto' kept in %s", cost_cache.path(self.costs_key()))
            else:
                log.info(
                    "measuring this machine's costs for gamma='auto' (target forwards over 1..%d tokens and a drafting "
                    "step: a few seconds, once per model pair, dtype and thread count; kept in %s with the acceptance "
                    "seen, so that only this first run drafts short, from a prior acceptance of 0.5)",
                    self.tuning.maximum + 1,
                    cost_cache.directory(),
                )
                self.tuning.costs = costs.measure(
                    self.target,
                    self.drafter,
                    ids,
                    self.tuning.maximum,
                    device,
                    extra=[n + 1 for n in self.tuning.trees],
                )
                log.debug("measured costs: %s", self.tuning.costs.to_dict())
        if self.tuning.trees:  # trees asked for after the chain's costs were measured (nothing to do if they were)
            self.tuning.costs.measure_more(self.target, ids, [n + 1 for n in self.tuning.trees], device)
        return self.tuning.costs

    def costs_key(self) -> dict[str, Any]:
        """What this generator's costs for gamma="auto" depend on (``hfspec.measure.cost_cache.key``), computed once."""
        if self._costs_key is None:
            self._costs_key = cost_cache.key(
                self.target, draft_module(self.drafter), self.drafter.describe(), self.describe()["fast_kernels"]
            )
        return self._costs_key

    def _kept(self) -> cost_cache.Kept:
        """What an earlier process kept of this pair on this machine (``hfspec.measure.cost_cache``), read once."""
        if self._kept_record is None:
            self._kept_record = cost_cache.kept(self.costs_key())
        return self._kept_record

    def keep_costs(self) -> None:
        """Write the costs, refined by the steps taken so far (the fastest seen, ``Costs.fastest``), back where the
        next process finds them."""
        if self.tuning.costs is not None:
            cost_cache.keep(self.costs_key(), self.tuning.costs.fastest(), self._reads_trees, self.tuning.memory)

    @property
    def draft(self) -> PreTrainedModel | None:
        """The draft model, for drafters that have one (``Drafter.model``)."""
        return self.drafter.model

    def describe(self) -> dict[str, Any]:
        """The drafter, whether the target and the draft run hfspec's CPU kernel (``hfspec.fast.describe``), and the
        CPU threads a call runs on unless it says otherwise."""
        draft = draft_module(self.drafter)
        kernels = {"target": fast.describe(self.target), "draft": fast.describe(draft)}
        integer = draft_linear.describe(draft)
        if integer["layers"]:  # a draft in integer arithmetic: its linears run the draft kernel
            dk = draft_linear.kernel()
            kernels["draft"] = {
                **kernels["draft"],
                "on": True,
                "reason": None,
                "integer": integer,
                "isa": kernels["draft"]["isa"] or (dk.isa if dk else None),
                "layers": kernels["draft"]["layers"] + integer["layers"],
            }
        threads = self.threads if self.threads is not None else torch.get_num_threads()
        arithmetic = kernels["target"].get("quantized", {}).get("arithmetic")  # GGUF blocks: "int8" or "float32"
        return {
            "drafter": self.drafter.describe(),
            "fast_kernels": kernels,
            "threads": threads,
            "arithmetic": arithmetic,
        }

    @classmethod
    def from_pretrained(
        cls, target: str | Path, draft: str | Path, *, ngram: bool = False, threads: int | None = None, **kwargs: Any
    ) -> SpeculativeGenerator:
        """Load both models and the target's tokenizer by hub name, local directory or GGUF file (see
        ``hfspec.drafters.loading``); ``draft="ngram"`` needs no model. A draft whose own tokenizer differs from the
        target's drafts through ``hfspec.drafters.cross_tokenizer`` without being asked. Both models run hfspec's CPU
        kernel where they sit on CPU in fp32 or bf16 (``fast_kernels=False`` keeps torch's linears); the
        constructor, given models, leaves them as they are (``hfspec.fast.accelerate(model)`` opts in).
        ``threads`` (as llama.cpp's ``-t``) is the CPU threads the loading and every ``generate`` call run on."""
        with cpu_threads.using(threads):  # the kernels' block shapes are timed for the count the calls run on
            return cls(*load_pair(target, draft, **kwargs), ngram=ngram, threads=threads)

    @torch.inference_mode()
    @_one_at_a_time
    @_in_threads
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
        gamma: int | str | GammaPolicy = "auto",
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        no_repeat_ngram_size: int | None = None,
        bad_words_ids: list[list[int]] | None = None,
        suppress_tokens: list[int] | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        logits_processor: Sequence[LogitsProcessor] | None = None,
        generation_config: GenerationConfig | None = None,
        sampling_params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        streamer: Any = None,
        on_context_limit: str = "error",
        tree: int | str | None = "auto",
        threads: int | None = None,
    ) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` per row, distributed exactly as the target's own sampling.

        Keyword names follow ``transformers.GenerationConfig``; ``None`` inherits from
        ``generation_config`` and then from the target's generation config. ``sampling_params`` (a
        ``hfspec.SamplingParams``) says all of them at once, in place of those keywords, ``logits_processor`` and
        ``generation_config``: its ``stop_token_ids`` are then every id that ends a row. ``do_sample``
        defaults to greedy; ``temperature=0`` also means greedy (exact argmax, equal to
        ``target.generate(do_sample=False)`` token for token where hfspec's CPU kernels run the target, in
        float32 and bfloat16; on torch's kernels in float32, up to rounding in half precision: README,
        Guarantees). ``gamma`` (γ) is the number of drafts per
        step, a ``GammaPolicy``, or ``"auto"``: γ from 0 (plain decoding) to K chosen each
        step from costs measured on this machine at the first call and the acceptance seen
        so far, drafting stopped early when the drafter is unsure (see ``AutoGamma``).
        Randomness comes only from ``generator`` (or a new
        one seeded with ``seed``; with neither, torch's global generator).
        ``on_context_limit``: ``"error"`` refuses prompts that would run past the models'
        context window; ``"stop"`` ends such rows there, with stop reason ``"context"``.
        ``tree``: ``None``/``0`` drafts a chain; a number drafts a tree of that many nodes per
        step, verified in one target forward (``hfspec.tree``; ``gamma`` is then unused);
        ``"auto"`` (the default) with ``gamma="auto"`` lets hfspec choose each step between the chain and trees of
        ``AUTO_TREES`` nodes by their expected tokens per second (``AutoGamma``); it means the chain
        with any other ``gamma``, and where a tree cannot be drafted or verified exactly (a recurrent
        model, a drafter that builds no trees, a processor that reads the text so far).
        ``threads``: the CPU threads this call runs on (torch's, which hfspec's kernels read), else the generator's
        ``threads``; torch's count is restored after the call.
        """
        if on_context_limit not in ("error", "stop"):
            raise HfspecError(f"on_context_limit must be 'error' or 'stop', got {on_context_limit!r}")
        options = {
            "max_new_tokens": max_new_tokens,
            "do_sample": do_sample,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
            "no_repeat_ngram_size": no_repeat_ngram_size,
            "bad_words_ids": bad_words_ids,
            "suppress_tokens": suppress_tokens,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
        }
        params, bos = self._params(sampling_params, generation_config, logits_processor, options)
        window = self._context_window()
        ids, mask = prepare_inputs(
            input_ids,
            attention_mask,
            self.tokenizer,
            self.vocab_size,
            window,
            params.max_new_tokens if on_context_limit == "error" else 1,
            bos,
        )
        reads_context = params.reads_context()
        nodes = self._tree_nodes(tree, reads_context)
        if isinstance(gamma, str) and gamma == "auto":
            self.tuning.trees = self._auto_trees(reads_context) if tree == "auto" else ()
            self.measure_costs(ids[0, mask[0].bool()].tolist())
            self.tuning.setting = params.key()
        policy = as_policy(gamma, self.tuning, self.drafter.mixes_sources)
        if streamer is not None and ids.shape[0] != 1:
            raise HfspecError("a streamer needs a single prompt (batch size 1); drop streamer= for batches")
        device = self.target.get_output_embeddings().weight.device
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(int(seed))
        # A recurrent state cannot skip padding or a masked hole, nor can a sliding window that transformers counts
        # in cache columns (a model without a mask per layer type, such as Mistral): then each prompt runs alone.
        alone = KVState.is_recurrent(self.target) or self.drafter.recurrent or window_in_columns(self.target)
        rows = [(r[m.bool()][None], m[m.bool()][None]) for r, m in zip(ids, mask)] if alone else [(ids, mask)]
        try:
            parts = [
                Call(self, params, policy, generator, streamer, window, nodes).run(r.to(device), m.to(device))
                for r, m in rows
            ]
        finally:
            if streamer is not None:
                streamer.end()
        if isinstance(gamma, str) and gamma == "auto":
            self.keep_costs()
        return stack(ids.to(device), parts, params.pad()) if alone else parts[0]

    def _params(
        self,
        given: SamplingParams | None,
        generation_config: GenerationConfig | None,
        logits_processor: Sequence[LogitsProcessor] | None,
        options: dict[str, Any],
    ) -> tuple[SamplingParams, int | None]:
        """The call's one ``SamplingParams`` (``given``, or built from the generation configs and keywords) and the
        BOS id an empty prompt starts from."""
        if given is None:
            conf, params = cfg.resolve(self.target.generation_config, generation_config, logits_processor, **options)
            return params, conf.bos_token_id
        if not isinstance(given, SamplingParams):
            raise HfspecTypeError(f"sampling_params must be a hfspec.SamplingParams, got {type(given).__name__}")
        others = {**options, "generation_config": generation_config, "logits_processor": logits_processor}
        also = [name for name, value in others.items() if value is not None]
        if also:
            raise HfspecError(
                f"pass the settings once: sampling_params= holds them all, so drop {', '.join(also)} "
                "(or set them in the SamplingParams)"
            )
        return given, self.target.generation_config.bos_token_id

    def _tree_nodes(self, tree: int | str | None, needs_context: bool) -> int:
        """The node budget of ``tree`` (0: the chain), or an ``HfspecError`` where a tree cannot be exact."""
        if tree is None or tree == "auto":  # auto: the policy chooses per step (``_auto_trees``)
            return 0
        if isinstance(tree, bool) or not isinstance(tree, int) or tree < 0:
            raise HfspecError(f"tree must be None, 'auto' or a node budget >= 0, got {tree!r}")
        if tree and (KVState.is_recurrent(self.target) or self.drafter.recurrent):
            raise HfspecError(
                "a recurrent (or hybrid) model keeps one state and cannot read a tree in one forward; "
                "use tree=None (a chain)"
            )
        if tree and needs_context:
            raise HfspecError(
                "a logits processor that reads the text so far (repetition_penalty, "
                "no_repeat_ngram_size, bad_words_ids, custom processors) would need each tree node's "
                "own path; use tree=None"
            )
        if tree:
            check_tree_attention(self.target, "target")
            if not self.target_reads_trees():
                raise HfspecError(
                    f"the target ({type(self.target).__name__}) did not read a draft tree exactly: its "
                    "logits for a small tree differ from chain forwards along each path (its attention "
                    "rebuilds the mask or positions it is given); use tree=None (a chain)"
                )
        return tree

    def target_reads_trees(self) -> bool:
        """Whether the target reads a tree's 4-D mask and positions exactly (``hfspec.tree.probe``; once)."""
        if self._reads_trees is None:  # kept beside the costs: the probe is a few forwards
            kept = self._kept().reads_trees
            self._reads_trees = reads_trees(self.target) if kept is None else kept
            if not self._reads_trees:
                log.warning(
                    "the target %s does not read draft trees exactly; it verifies chains only",
                    type(self.target).__name__,
                )
        return self._reads_trees

    def drafts_trees(self) -> bool:
        """Whether this pair drafts real trees and verifies them exactly (given processors that allow them)."""
        return (
            builds_trees(self.drafter)
            and not (KVState.is_recurrent(self.target) or self.drafter.recurrent)
            and not window_in_columns(self.target)
            and self.target_reads_trees()
        )

    def _auto_trees(self, needs_context: bool) -> tuple[int, ...]:
        """The node budgets ``tree="auto"`` may choose: none where a tree cannot be exact or the drafter builds
        none (the hybrid prices its own lookup against its model, for chains), those that fit the window."""
        if needs_context or not self.drafts_trees() or self.drafter.mixes_sources:
            return ()
        window = self._context_window()
        return tuple(n for n in AUTO_TREES if window is None or n + 1 <= window // 2)

    def _context_window(self) -> int | None:
        models = [self.target] + ([self.draft] if self.draft is not None else [])
        windows = [getattr(m.config.get_text_config(), "max_position_embeddings", None) for m in models]
        windows = [w for w in windows if w]
        return min(windows) if windows else None


def stack(ids: torch.Tensor, parts: list[GenerateOutput], pad: int) -> GenerateOutput:
    """One output for prompts ``ids`` (B, T) that ran one at a time, as if they had run as a batch."""
    new = right_pad([p.sequences[0, p.prompt_length :] for p in parts], pad, ids.device)
    return GenerateOutput(torch.cat([ids, new], dim=1), Stats.combine([p.stats for p in parts]), ids.shape[1])
