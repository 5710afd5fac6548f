"""Caches that keep a recurrent state: snapshot, restore and replay, or a clear refusal.

State-space and hybrid models (Mamba, Mamba-2, gated delta-nets, short convolutions)
keep, per recurrent layer, a convolution state and a recurrent (SSM or delta-rule)
state that summarise every token so far. Unlike a key/value cache such a state cannot
be cropped: after a verification forward over γ+1 tokens it has absorbed every draft,
accepted or not. So, for one row at a time (a state cannot skip a masked hole):

1. ``snapshot`` clones the conv/recurrent states before the forwards that may be rolled back;
2. ``rollback`` restores them and advances them by exactly the accepted tokens, either
   - with an *adapter* (the mixer classes in ``MIXERS``): forward pre-hooks record each
     recurrent mixer's input while recording, and only those mixers are re-run on the first
     ``keep`` recorded positions (attention, MLPs and the head are not recomputed), or
   - on the *generic* path (any other recurrent cache): the accepted tokens are fed through
     the whole model again, after the attention layers are cropped back to the snapshot.
   When every column is kept, nothing is replayed.
Attention key/value caches are cropped as for any model.

What cannot be made exact is refused by ``check`` before any generation (see the README's
"Architectures" table). ``hfspec.measure.costs.rollback_cost`` measures what the rollback adds to v(γ).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from hfspec.errors import HfspecError
from hfspec.models.adapter import forward

log = logging.getLogger(__name__)

# Recurrent mixer modules that the adapter path re-runs: each is called as
# ``mixer(hidden_states, cache=..., attention_mask=...)`` and updates only its own layer's state.
MIXERS = frozenset(
    {
        "MambaMixer",
        "FalconMambaMixer",
        "JambaMambaMixer",  # Mamba-1 selective scan
        "Mamba2Mixer",
        "FalconH1Mixer",
        "BambaMixer",
        "GraniteMoeHybridMambaLayer",
        "NemotronHMamba2Mixer",
        "Zamba2MambaMixer",  # Mamba-2 (SSD) scan
        "Qwen3NextGatedDeltaNet",
        "Qwen3_5GatedDeltaNet",
        "OlmoHybridGatedDeltaNet",  # gated delta rule
        "Lfm2ShortConv",
        "Lfm3ShortConv",  # short convolutions (conv state only)
    }
)
# transformers' Mamba-1 scan ignores the cached SSM state on a multi-token input (it starts from
# zero), so these mixers can only continue one token at a time.
SERIAL_MIXERS = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"})
# Models that keep their recurrent state inside their own modules, where no cache can reach it.
STATE_IN_MODULES = {"recurrent_gemma": "RecurrentGemmaRecurrentBlock"}
# Cache layers this module can snapshot and crop; sliding windows are kept whole (see build_cache).
SUPPORTED_LAYERS = (DynamicLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer, DummyLayer)
LINEAR_TYPES = frozenset(
    t for t, cls in DYNAMIC_LAYER_TYPE_MAPPING.items() if issubclass(cls, LinearAttentionCacheLayerMixin)
)


def layer_types(model: Any) -> list[str]:
    """The cache layer type of each decoder layer, as transformers' ``DynamicCache(config=...)`` sees it."""
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    return list(types)


def is_recurrent(model: Any) -> bool:
    """True when ``model`` keeps a recurrent state (which cannot be cropped, nor skip a masked hole)."""
    if getattr(model, "_is_stateful", False):
        return True
    try:
        return any(t in LINEAR_TYPES for t in layer_types(model))
    except (AttributeError, TypeError):  # a config without per-layer information: attention only
        return False


def build_cache(model: Any) -> DynamicCache:
    """The model's own cache layout (``DynamicCache(config=...)``), with sliding windows kept whole.

    A window-sized key/value layer cannot be cropped once the window is full; kept whole, the
    model's sliding-window mask does the windowing, exactly as for attention-only models.
    """
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
            cache.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
        elif type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = DynamicLayer()
    return cache


def mixer_classes(model: Any) -> set[str]:
    return {type(m).__name__ for m in model.modules() if type(m).__name__ in MIXERS}


def check(model: Any, role: str) -> None:
    """Raise ``HfspecError`` when ``model``'s state cannot be rolled back exactly, before any generation.

    ``role`` is "target" or "draft". Attention-only models always pass.
    """
    if not is_recurrent(model):
        return
    arch = model.config.get_text_config(decoder=True).model_type
    if arch in STATE_IN_MODULES:
        raise HfspecError(
            f"the {role} ({arch}) keeps the recurrent state of its {STATE_IN_MODULES[arch]} layers inside its "
            "modules, where no cache snapshot can reach it, so a rejected draft could not be rolled back; "
            f"use target.generate() without speculation{_instead(role)}"
        )
    try:
        types = layer_types(model)
        cache = build_cache(model)
    except KeyError as exc:
        raise HfspecError(
            f"the {role} ({arch}) uses the cache layer type {exc.args[0]!r}, which hfspec cannot snapshot and roll "
            f"back; use target.generate() without speculation{_instead(role)}"
        ) from None
    if not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers):
        raise HfspecError(
            f"the {role} ({arch}) keeps its recurrent state outside transformers' Cache (its layers are "
            f"{sorted(set(types))}), so a rejected draft could not be rolled back; use target.generate() without "
            f"speculation{_instead(role)}"
        )
    for kind, layer in zip(types, cache.layers):
        if type(layer) not in SUPPORTED_LAYERS:
            raise HfspecError(
                f"the {role} ({arch}) has {kind!r} layers ({type(layer).__name__}), whose cache hfspec cannot "
                f"snapshot and roll back; use target.generate() without speculation{_instead(role)}"
            )
    serial = sorted(mixer_classes(model) & SERIAL_MIXERS)
    if role == "target" and serial:
        raise HfspecError(
            f"the target ({arch}) has {serial[0]} layers: transformers' Mamba-1 scan restarts from a zero state on a "
            "multi-token input with a cache, so it cannot verify γ+1 tokens in one forward, and verifying them one "
            "at a time is never faster than target.generate(); use target.generate(), a Mamba-2 or hybrid target, "
            f"or this model as the draft of another target (exact)"
        )
    if not mixer_classes(model):
        log.warning(
            "%s %s: no rollback adapter for its recurrent layers; using the generic path (replay the "
            "accepted tokens through the whole model)",
            role,
            arch,
        )


def _instead(role: str) -> str:
    return ", or an attention-only draft" if role == "draft" else ""


@dataclass
class _Saved:
    """Clones of one linear layer's states (None: not initialised) and its ``has_previous_state``."""

    conv: dict[int, torch.Tensor | None]
    recurrent: dict[int, torch.Tensor | None]
    has_previous: dict[int, bool]


class RecurrentState:
    """The recurrent layers of one model's cache (one row): snapshot, restore and replay.

    With ``adapter=False`` the generic path is used even where an adapter exists
    (``hfspec.measure.costs.rollback_cost`` compares the two).
    """

    def __init__(self, model: Any, adapter: bool = True):
        self.model = model
        self.cache = build_cache(model)
        layers = self.cache.layers
        self.linear = [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.attention = [i for i, layer in enumerate(layers) if isinstance(layer, DynamicLayer)]
        mixers = {m.layer_idx: m for m in model.modules() if type(m).__name__ in MIXERS}
        self.serial = any(type(m).__name__ in SERIAL_MIXERS for m in mixers.values())
        # The adapter needs a known mixer for every recurrent layer.
        self.mixers = mixers if adapter and set(mixers) == set(self.linear) else {}
        self.saved: list[tuple[int, _Saved]] | None = None
        self.inputs: dict[int, list[torch.Tensor]] = {}  # recorded mixer inputs, per layer
        self.hooks: list[Any] = []
        # Hooks never outlive this state, even if a rollback never comes (an error mid-step).
        weakref.finalize(self, _remove_hooks, self.hooks)

    @property
    def mechanism(self) -> str:
        return "adapter" if self.mixers else "generic"

    @property
    def attends(self) -> bool:
        """Whether any layer attends (and so reads the whole 2-D mask, not only the new columns)."""
        return bool(self.attention)

    def seq_length(self, columns: int) -> int:
        """Positions held by the attention layers; ``columns`` when there are none."""
        return self.cache.get_seq_length() if self.attention else columns

    # -- snapshot and restore ---------------------------------------------------------------

    def snapshot(self) -> None:
        """Clone every conv/recurrent state; start recording the mixers' inputs."""
        self._stop_recording()
        self.saved = []
        for i in self.linear:
            layer = self.cache.layers[i]
            self.saved.append(
                (
                    i,
                    _Saved(
                        conv={k: _clone(v) for k, v in layer.conv_states.items()},
                        recurrent={k: _clone(v) for k, v in layer.recurrent_states.items()},
                        has_previous=dict(layer.has_previous_state),
                    ),
                )
            )
        if self.mixers:
            self._record()

    def _restore(self) -> None:
        for i, saved in self.saved:
            layer = self.cache.layers[i]
            for states, clones in ((layer.conv_states, saved.conv), (layer.recurrent_states, saved.recurrent)):
                for k, clone in clones.items():
                    if clone is not None:
                        states[k].copy_(clone)  # in place: the layer's tensors keep their identity
            # A state created after the snapshot (the first forward) counts as absent again.
            layer.has_previous_state.update(saved.has_previous)

    def _crop_attention(self, remove: int) -> None:
        if remove > 0:
            for i in self.attention:
                # The key/value part only: a hybrid layer's own crop would also try its linear states.
                DynamicLayer.crop(self.cache.layers[i], -remove)

    # -- recording the mixers' inputs ---------------------------------------------------------

    def _record(self) -> None:
        self.inputs = {i: [] for i in self.mixers}
        ref = weakref.ref(self)

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            state = ref()
            # Only forwards on this cache: the same model may serve another cache (draft = target).
            if state is not None and kwargs.get("cache") is state.cache:
                hidden = args[0] if args else kwargs["hidden_states"]
                state.inputs[module.layer_idx].append(hidden.detach().clone())

        self.hooks.extend(m.register_forward_pre_hook(hook, with_kwargs=True) for m in self.mixers.values())

    def _stop_recording(self) -> None:
        _remove_hooks(self.hooks)

    # -- rollback ---------------------------------------------------------------------------

    def rollback(self, keep: int, start: int, mask: torch.Tensor, ids: torch.Tensor | None) -> None:
        """Leave the state as if only the first ``keep`` columns written since ``start`` had been fed.

        ``mask`` (1, L) covers every column written; ``ids`` (1, ≥keep) are the tokens they read.
        """
        self._stop_recording()
        assert self.saved is not None, "a recurrent cache is rolled back to its snapshot: call snapshot() first"
        written = mask.shape[1] - start
        if keep < written:  # else everything is kept: the state is already right
            self._restore()
            if keep and self.mixers and all(self.inputs.values()):
                self._crop_attention(written - keep)  # the accepted columns' keys/values stay
                self._replay_mixers(keep)
            else:
                self._crop_attention(written)
                if keep:
                    assert ids is not None and ids.shape[1] >= keep, "the generic replay needs the tokens read"
                    self._replay_tokens(ids[:, :keep], start, mask)
        self.saved, self.inputs = None, {}

    def _chunks(self, k: int) -> list[slice]:
        """One slice of all k positions, or one per position for mixers that cannot continue several."""
        return [slice(t, t + 1) for t in range(k)] if self.serial else [slice(0, k)]

    def _replay_mixers(self, keep: int) -> None:
        """Re-run each recurrent mixer on its recorded inputs at the kept positions (one row: no padding)."""
        for i, mixer in self.mixers.items():
            hidden = torch.cat(self.inputs[i], dim=1)[:, :keep]
            for part in self._chunks(keep):
                mixer(hidden_states=hidden[:, part], cache=self.cache, attention_mask=None)

    def _replay_tokens(self, ids: torch.Tensor, start: int, mask: torch.Tensor) -> None:
        """Feed the kept tokens through the whole model again, at their positions."""
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        for part in self._chunks(ids.shape[1]):
            end = start + part.stop
            cols = mask[:, :end] if self.attends else mask[:, start + part.start : end]
            forward(self.model, ids[:, part], cols, positions[:, part], self.cache, logits_to_keep=1)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _remove_hooks(hooks: list[Any]) -> None:
    """Remove and forget ``hooks`` (the list is emptied in place)."""
    for h in hooks:
        h.remove()
    hooks.clear()
