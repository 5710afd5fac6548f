"""Text in, text out: ``hfspec.generate("Write a haiku.")``.

The pair is loaded once per process and reused: calls with the same models and
loading options (compared by value) share one ``SpeculativeGenerator``, which serves
one call at a time (threads wait their turn); the ``MAX_PAIRS`` most recently used
pairs stay loaded. With no target, draft or config, the ``smollm2-offline`` preset
is used (SmolLM2-135M-Instruct and the EAGLE-3 head shipped for it, chat template on).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import GenerationConfig, PreTrainedTokenizerBase

from hfspec.cpu import threads as cpu_threads
from hfspec.decoding import config as cfg
from hfspec.decoding.stats import Stats
from hfspec.drafters import loading
from hfspec.errors import HfspecError, HfspecTypeError
from hfspec.generator import SpeculativeGenerator
from hfspec.models.presets import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRESET, Preset, load_preset
from hfspec.models.weights import DRAFT_BITS, parse_dtype
from hfspec.policy import GammaPolicy

__all__ = [
    "Completion",
    "DEFAULT_PRESET",
    "MAX_PAIRS",
    "PairCache",
    "clear_cache",
    "complete",
    "encode",
    "generate",
    "load",
    "resolve_preset",
]

log = logging.getLogger(__name__)

# Pairs kept loaded at most: each holds two models, and a process rarely alternates between more.
MAX_PAIRS = 3


@dataclass(frozen=True)
class Completion:
    """What one call produced, row by row, and the settings it ran with."""

    texts: tuple[str, ...]  # new text only, special tokens skipped
    tokens: tuple[tuple[int, ...], ...]  # new token ids
    stats: Stats
    settings: dict[str, Any]


def resolve_preset(
    target: str | Path | None = None,
    draft: str | Path | None = None,
    config: str | Path | Preset | None = None,
    ngram: bool | None = None,
) -> Preset:
    """The pair to use: a preset (by name, path or object), a target/draft pair, or the default;
    ``ngram`` (not None) overrides the preset's."""
    if config is not None:
        if target is not None or draft is not None:
            raise HfspecError("pass either a config preset or target and draft, not both")
        preset = config if isinstance(config, Preset) else load_preset(config)
    elif target is None and draft is None:
        preset = load_preset(DEFAULT_PRESET)
    elif target is None or draft is None:
        missing = "target" if target is None else "draft"
        raise HfspecError(
            f"no {missing} given: pass both target and draft (or a config preset, or neither "
            f"for the default {DEFAULT_PRESET} pair)"
        )
    else:
        preset = Preset(name="custom", target=str(target), draft=str(draft))
    if ngram is not None and not isinstance(ngram, bool):
        raise HfspecTypeError(f"ngram must be True or False, got {ngram!r}")
    return preset if ngram is None else dataclasses.replace(preset, ngram=ngram)


class _Same:
    """A loading option with no value to compare by (an object without ``to_dict``, unhashable): the key holds it
    and compares it by identity, so that its id cannot be reused by another object while the pair is cached."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _key(value: Any) -> Hashable:
    """A hashable key equal for equal loading options: dicts (a ``device_map``) by their items in any order, lists
    and tuples by their items, configs by ``to_dict()``, dtypes by what they name ("bf16" is torch.bfloat16)."""
    if isinstance(value, dict):
        items = ((k, parse_dtype(v) if k in ("dtype", "draft_dtype") else v) for k, v in value.items())
        return ("dict", tuple(sorted(((_key(k), _key(v)) for k, v in items), key=repr)))
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_key(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted((_key(v) for v in value), key=repr)))
    if callable(getattr(value, "to_dict", None)):
        return (type(value).__qualname__, _key(value.to_dict()))
    try:
        hash(value)
    except TypeError:
        return _Same(value)
    return value


class PairCache:
    """Loaded generators by key, thread-safe: the ``size`` most recently used are kept (the least recently used goes
    first), and a pair that several threads ask for at once is loaded once while they wait."""

    def __init__(self, size: int):
        self.size = size
        self._pairs: OrderedDict[Hashable, SpeculativeGenerator] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[Hashable, threading.Lock] = {}  # a lock per pair being loaded

    def _cached(self, key: Hashable) -> SpeculativeGenerator | None:
        with self._lock:
            if key in self._pairs:
                self._pairs.move_to_end(key)
                return self._pairs[key]
        return None

    def get(self, key: Hashable, load: Callable[[], SpeculativeGenerator]) -> SpeculativeGenerator:
        """The pair for ``key``, loaded with ``load()`` unless it is cached."""
        found = self._cached(key)
        if found is not None:
            return found
        with self._lock:
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:  # other pairs load and serve meanwhile
            found = self._cached(key)
            if found is not None:
                return found
            try:
                pair = load()
            finally:
                with self._lock:
                    self._loading.pop(key, None)
            with self._lock:
                self._pairs[key] = pair
                while len(self._pairs) > self.size:
                    self._pairs.popitem(last=False)
            return pair

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._pairs)

    def values(self) -> list[SpeculativeGenerator]:
        with self._lock:
            return list(self._pairs.values())

    def __len__(self) -> int:
        return len(self._pairs)

    def clear(self) -> None:
        with self._lock:
            self._pairs.clear()


_PAIRS = PairCache(MAX_PAIRS)


def load(preset: Preset, *, threads: int | None = None, **load_kwargs: Any) -> SpeculativeGenerator:
    """The generator for ``preset``, loaded on first use and cached for the process (``MAX_PAIRS`` of them, by the
    models and the loading options' values); loaded on ``threads`` CPU threads (None: torch's count), so that the
    kernels' block shapes are timed for the calls that pass the same count."""
    cpu_threads.check(threads)
    # fast_kernels and draft_bits are spelled out so that leaving them unset and passing their defaults share a pair.
    kwargs = {"fast_kernels": True, "draft_bits": DRAFT_BITS, **preset.load_kwargs(), **load_kwargs}

    def load_pair() -> SpeculativeGenerator:
        log.info("loading target %s and draft %s", preset.target, preset.draft)
        with cpu_threads.using(threads):
            return SpeculativeGenerator(*loading.load_pair(preset.target, preset.draft, **kwargs), ngram=preset.ngram)

    return _PAIRS.get((preset.target, preset.draft, preset.ngram, _key(kwargs)), load_pair)


def clear_cache() -> None:
    """Forget every loaded pair (frees their memory once nothing else holds them)."""
    _PAIRS.clear()


def encode(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], *, chat: bool, system: str | None = None
) -> list[list[int]]:
    """Token ids of each prompt; with ``chat`` wrapped as a user turn in the chat template."""
    if system is not None and not chat:
        raise HfspecError("a system message needs the chat template: turn chat on (chat=True / --chat)")
    if not chat:
        return [list(tokenizer(p)["input_ids"]) for p in prompts]
    if not getattr(tokenizer, "chat_template", None):
        raise HfspecError(
            "this tokenizer has no chat template; turn chat off (chat=False / --no-chat) "
            "or use an instruct model that ships one"
        )
    ids = []
    for p in prompts:
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": p})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return ids


def _pick(value: Any, default: Any) -> Any:
    return value if value is not None else default


def complete(
    gen: SpeculativeGenerator,
    prompts: list[str],
    *,
    preset: Preset,
    generation_config: GenerationConfig | None = None,
    gamma: int | str | GammaPolicy | None = None,
    seed: int | None = None,
    chat: bool | None = None,
    system: str | None = None,
    streamer: Any = None,
    tree: int | str | None = "auto",
    threads: int | None = None,
) -> Completion:
    """Generate for text prompts with ``gen``. The settings ``generation_config`` sets
    (``hfspec.decoding.config.settings``) override ``preset``'s sampling settings, which override the target's
    generation config; decoding is greedy unless one of them samples, and ``DEFAULT_MAX_NEW_TOKENS`` long unless one of
    them (or the target's generation config) sets ``max_new_tokens``. They make the call's one ``SamplingParams``.
    Other unset settings come from ``preset``. ``threads``: the CPU threads of the call (None: the generator's)."""
    if gen.tokenizer is None:
        raise HfspecError(
            "the generator has no tokenizer; build it with SpeculativeGenerator(target, draft, tokenizer)"
        )
    own = gen.target.generation_config
    # hfspec's defaults sit above the target's config (greedy unless asked), but keep its max_new_tokens.
    defaults = cfg.settings(max_new_tokens=_pick(own.max_new_tokens, DEFAULT_MAX_NEW_TOKENS), do_sample=False)
    given = cfg.merge(cfg.merge(defaults, cfg.settings(**preset.sampling())), generation_config)
    params = cfg.resolve(own, given)[1]
    chat = bool(_pick(chat, preset.chat))
    system = system if system is not None else (preset.system if chat else None)
    described = gen.describe()
    settings = {
        "preset": preset.name,
        "target": preset.target,
        "draft": preset.draft,
        "drafter": gen.drafter.kind,
        "gamma": _pick(gamma, preset.gamma),
        "max_new_tokens": params.max_new_tokens,
        "do_sample": not params.greedy,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "repetition_penalty": params.repetition_penalty,
        "seed": seed,
        "chat": chat,
        "system": system,
        "tree": tree,
        "fast_kernels": described["fast_kernels"],
        "threads": _pick(cpu_threads.check(threads), described["threads"]),
    }
    ids = encode(gen.tokenizer, prompts, chat=chat, system=system)
    out = gen.generate(
        ids, sampling_params=params, gamma=settings["gamma"], seed=seed, streamer=streamer, tree=tree, threads=threads
    )
    start = out.prompt_length
    tokens = tuple(
        tuple(out.sequences[i, start : start + row.committed].tolist()) for i, row in enumerate(out.stats.rows)
    )
    texts = tuple(gen.tokenizer.decode(list(t), skip_special_tokens=True) for t in tokens)
    if isinstance(settings["gamma"], GammaPolicy):
        settings["gamma"] = str(settings["gamma"])
    return Completion(texts, tokens, out.stats, settings)


def generate(
    prompt: str | list[str],
    *,
    target: str | Path | None = None,
    draft: str | Path | None = None,
    config: str | Path | Preset | None = None,
    max_new_tokens: int | None = None,
    gamma: int | str | GammaPolicy | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    chat: bool | None = None,
    system: str | None = None,
    ngram: bool | None = None,
    streamer: Any = None,
    tree: int | str | None = "auto",
    return_stats: bool = False,
    generation_config: GenerationConfig | None = None,
    threads: int | None = None,
    **load_kwargs: Any,
) -> str | list[str] | tuple[str | list[str], Stats]:
    """Continue ``prompt`` (one string or a list) with speculative decoding; returns the new text only.

    The pair is ``target`` + ``draft`` (hub names, directories or ``.gguf`` files), or a ``config`` preset
    (a shipped name such as ``"qwen2.5-7b"`` or a JSON path), or by default the
    offline SmolLM2 pair. ``draft="ngram"`` drafts by lookup in the prompt and earlier
    outputs, with no draft model; ``ngram=True`` adds that lookup to a model draft (per
    row, whichever is expected to get more accepted). Settings left as ``None`` come
    from the preset, then from the target's generation config; ``do_sample`` defaults
    to greedy, ``max_new_tokens`` to ``DEFAULT_MAX_NEW_TOKENS`` and ``chat`` to off (on for the default pair). ``gamma`` is γ, the drafts
    per step, ``"auto"`` (the default of every shipped preset: chosen at every step, see
    ``AutoGamma``) or a ``GammaPolicy``. ``tree``: a node budget drafts a tree per step, verified
    in one target forward; ``None`` drafts chains; ``"auto"`` (the default) lets ``gamma="auto"`` choose
    each step between the chain and trees (see ``SpeculativeGenerator.generate``).
    ``generation_config`` (a ``transformers.GenerationConfig``) sets any of them at once; the keyword arguments
    override it. ``seed`` makes sampling reproducible. ``load_kwargs`` go to ``hfspec.drafters.loading.load_pair``
    (``dtype``, ``device``, ``device_map``, ``fast_kernels=False`` to keep torch's own linears on CPU, ...).
    ``threads`` is the CPU threads the call (and a first load of the pair) runs on, as llama.cpp's ``-t``; by
    default torch's count. With ``return_stats`` the result is ``(text, stats)``.
    """
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    else:
        raise HfspecTypeError(
            "prompt must be a string or a non-empty list of strings; for token ids use SpeculativeGenerator.generate"
        )
    preset = resolve_preset(target, draft, config, ngram)
    gen = load(preset, threads=threads, **load_kwargs)
    sampling = cfg.merge(
        generation_config,
        cfg.settings(
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
        ),
    )
    result = complete(
        gen,
        prompts,
        preset=preset,
        generation_config=sampling,
        gamma=gamma,
        seed=seed,
        chat=chat,
        system=system,
        streamer=streamer,
        tree=tree,
        threads=threads,
    )
    text: str | list[str] = result.texts[0] if isinstance(prompt, str) else list(result.texts)
    return (text, result.stats) if return_stats else text
