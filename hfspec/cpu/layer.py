"""The Llama/Qwen2 decoder layer in one kernel call on CPU, with the bits of its switched modules.

Once :mod:`hfspec.cpu.fast` has switched a layer's parts (its two RMSNorms to :mod:`hfspec.cpu.norms`, its attention
to :mod:`hfspec.cpu.rotary`'s forward on :mod:`hfspec.cpu.attention`'s kernel, its gated MLP to :mod:`hfspec.cpu.mlp`,
its projections to kernel-backed linears), a one-token forward of a 1.5B model still spends about a third of its time
around the kernels: two dozen module calls, torch ops and ctypes calls per layer, a few microseconds each.
:class:`LeanLayer` makes the same kernel calls from C (``hfspec/cpu/csrc/layer.cpp``): the norm, the three
projections (each the entry its module's forward would call, with the same arguments: :mod:`hfspec.cpu.c_linear`),
the rotary, the new keys and values written into the cache's buffers, attention over the filled columns, the o
projection, the float32 residual sum, and the same again for the MLP. The output has the module path's bits, row for
row (tests/test_lean_layer.py), so a step, a verification, a tree and a prefill still agree.

:func:`use` switches the decoder layers whose forward is transformers' ``LlamaDecoderLayer``/``Qwen2DecoderLayer`` one
(read from the source) to a subclass of their own class (so that transformers' output hooks still find them);
:func:`unuse` switches them back. A call the C path does not serve runs the layer's own forward: gradients, another
device or dtype, parts not switched or hooked, a cache that is not hfspec's buffered one (:mod:`hfspec.models.
kv_buffer`) or not yet written, another attention implementation, extra arguments.
"""

from __future__ import annotations

import array
import ast
import ctypes
import functools
from dataclasses import dataclass

import torch
from torch import nn

from hfspec.cpu import attention as cpu_attention
from hfspec.cpu import kernels
from hfspec.cpu.activations import InvariantActivation
from hfspec.cpu.c_linear import CLinear
from hfspec.cpu.mlp import GatedMLP
from hfspec.cpu.norms import FusedRMSNorm, body_of
from hfspec.cpu.rotary import LeanAttention

__all__ = ["LeanLayer", "bind", "unuse", "use"]

_ENTRY = None  # the kernel's entry, bound by use()
# LlamaDecoderLayer.forward (Qwen2's is the same): the computation LeanLayer reproduces.
_LLAMA = "\n".join(
    ast.unparse(statement)
    for statement in ast.parse(
        """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(
    hidden_states=hidden_states,
    attention_mask=attention_mask,
    position_ids=position_ids,
    cache=cache,
    use_cache=use_cache,
    position_embeddings=position_embeddings,
    **kwargs,
)
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""
    ).body
)
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # of self_attn
_MLP = ("gate_proj", "up_proj", "down_proj")  # of mlp


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("type", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("ldw", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("plan", ctypes.c_void_p),
        ("plan_len", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _Linear) for name in ("q", "k", "v", "o", "gate", "up", "down")),
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "act")),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


@dataclass(frozen=True)
class _Plan:
    """A layer's C arguments, valid while its ``key`` (:func:`_key`) stays the same; ``layer`` None: not served."""

    key: tuple
    layer: _Layer | None = None
    keep: tuple = ()  # the tensors the pointers in ``layer`` point into
    max_rows: int | None = None
    causal: bool = True  # the attention module's own is_causal


@functools.cache
def _decoder_forward(kind: type) -> bool:
    return body_of(kind.forward) == _LLAMA


def _parts(layer: nn.Module) -> tuple[nn.Module, ...] | None:
    """The layer's norms, attention, MLP and projections, or None where one is missing."""
    modules = layer._modules
    attn, mlp = modules.get("self_attn"), modules.get("mlp")
    if attn is None or mlp is None:
        return None
    found = (
        modules.get("input_layernorm"),
        modules.get("post_attention_layernorm"),
        attn,
        mlp,
        *(attn._modules.get(name) for name in _PROJECTIONS),
        *(mlp._modules.get(name) for name in _MLP),
        mlp._modules.get("act_fn"),
    )
    return None if any(part is None for part in found) else found


def _key(parts: tuple[nn.Module, ...]) -> tuple | None:
    """What a plan depends on: the parts, their classes, where their tensors live and the settings their forwards
    read (a part replaced, switched back, a weight reloaded or retimed makes another key); None where a part has
    hooks (they run only through the module path)."""
    key: list = []
    for part in parts:
        attributes = part.__dict__
        if (
            attributes["_forward_hooks"]
            or attributes["_forward_pre_hooks"]
            or attributes["_backward_hooks"]
            or attributes["_backward_pre_hooks"]
        ):
            return None
        key += (part, type(part), attributes["training"], attributes.get("plan"), attributes.get("arithmetic"))
        key += (attributes.get("max_rows"), attributes.get("variance_epsilon"))
        key += [None if t is None else t.data_ptr() for t in attributes["_parameters"].values()]
        key += [None if t is None else t.data_ptr() for t in attributes["_buffers"].values()]
    return tuple(key)


def _c(linear: CLinear, keep: list) -> _Linear:
    keep.append(linear.weight)
    if linear.bias is not None:
        keep.append(linear.bias)
    plan = array.array("q", linear.plan)
    keep.append(plan)
    return _Linear(
        int(linear.kind),
        linear.type,
        linear.weight.data_ptr(),
        linear.ldw,
        None if linear.bias is None else linear.bias.data_ptr(),
        linear.n,
        linear.k,
        plan.buffer_info()[0] if linear.plan else None,
        len(linear.plan),
    )


def _plan(key: tuple, parts: tuple[nn.Module, ...]) -> _Plan:
    """The C arguments of a layer whose parts are all switched and hook-free, or a plan that serves nothing."""
    norm1, norm2, attn, mlp, *linears, act = parts
    if (
        _ENTRY is None
        or type(norm1) is not FusedRMSNorm
        or type(norm2) is not FusedRMSNorm
        or type(attn) is not LeanAttention
        or type(mlp) is not GatedMLP
        or type(act) is not InvariantActivation
        or (attn.training and getattr(attn, "attention_dropout", 0.0))
    ):
        return _Plan(key)
    c_linears = [getattr(linear, "c_linear", lambda: None)() for linear in linears]
    if any(c is None for c in c_linears):
        return _Plan(key)
    q, k, v, o, gate, up, down = c_linears
    head_dim, hidden = attn.head_dim, q.k
    norms = (norm1.weight, norm2.weight)
    if (
        any(not (w.is_cpu and w.dtype is torch.float32 and w.is_contiguous() and w.shape == (hidden,)) for w in norms)
        or head_dim % 2
        or q.n % head_dim
        or k.n % head_dim
        or (q.n // head_dim) % (k.n // head_dim)
        or v.n != k.n
        or (k.k, v.k, o.k, o.n, gate.k, up.k) != (hidden, hidden, q.n, hidden, hidden, hidden)
        or gate.n != up.n
        or (down.k, down.n) != (gate.n, hidden)
    ):
        return _Plan(key)
    keep: list = [*norms]
    scale = attn.scaling if attn.scaling is not None else head_dim**-0.5
    layer = _Layer(
        *(_c(linear, keep) for linear in c_linears),
        norm1.weight.data_ptr(),
        norm2.weight.data_ptr(),
        hidden,
        q.n // head_dim,
        k.n // head_dim,
        head_dim,
        gate.n,
        act.hfspec_kind,
        norm1.variance_epsilon,
        norm2.variance_epsilon,
        scale,
    )
    rows = [c.max_rows for c in c_linears if c.max_rows is not None]
    causal = bool(getattr(attn, "is_causal", True))
    return _Plan(key, layer, tuple(keep), min(rows) if rows else None, causal)


def _rebuilt(original: type) -> nn.Module:
    """A bare :class:`LeanLayer` of ``original``'s lean class, for a copy or an unpickled layer (its state is set
    after): the lean class is made again where the process has not made it yet."""
    module = original.__new__(_lean_class(original))
    module.__dict__["hfspec_original"] = original
    return module


class LeanLayer:
    """The forward of a Llama-like decoder layer as one kernel call (see the module doc). Mixed into a subclass of the
    layer's own class by :func:`use`."""

    hfspec_original: type
    hfspec_plan: _Plan | None = None

    def __reduce_ex__(self, protocol: int):
        # copied and pickled by its own class (the lean one is made at run time), without the plan's C pointers
        state = {k: v for k, v in self.__dict__.items() if k not in ("hfspec_plan", "hfspec_original")}
        return _rebuilt, (self.hfspec_original,), state

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: object | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        out = None if kwargs else _run(self, hidden_states, attention_mask, cache, position_embeddings)
        if out is not None:
            return out
        return self.hfspec_original.forward(
            self,
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )


def _global_hooks() -> bool:
    module = nn.modules.module
    return bool(
        module._global_forward_hooks
        or module._global_forward_pre_hooks
        or module._global_backward_hooks
        or module._global_backward_pre_hooks
    )


def _run(
    layer: LeanLayer,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    cache: object,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor | None:
    """The layer's output from the C path, or None where it does not serve this call (nothing written then)."""
    if (
        torch.is_grad_enabled()
        or position_embeddings is None
        or x.dtype is not torch.float32
        or not x.is_cpu
        or x.dim() != 3
        or not x.is_contiguous()
    ):
        return None
    parts = _parts(layer)
    key = None if parts is None or _global_hooks() else _key(parts)
    if key is None:
        return None
    plan = layer.hfspec_plan
    if plan is None or plan.key != key:
        plan = layer.__dict__["hfspec_plan"] = _plan(key, parts)
    if plan.layer is None:
        return None
    attn = parts[2]
    batch, tokens, hidden = x.shape
    if (
        hidden != plan.layer.hidden
        or (plan.max_rows is not None and batch * tokens > plan.max_rows)
        or attn.config._attn_implementation != cpu_attention.IMPLEMENTATION
    ):
        return None
    cos, sin = position_embeddings
    head_dim = plan.layer.head_dim
    if not (
        cos.dtype is sin.dtype is torch.float32
        and cos.is_cpu
        and sin.is_cpu
        and cos.dim() == 3
        and cos.shape[0] in (1, batch)
        and cos.shape[1:] == (tokens, head_dim)
        and cos.stride(-1) == 1
        and sin.shape == cos.shape
        and sin.stride() == cos.stride()
    ):
        return None
    columns = _columns(cache, attn.layer_idx, batch, plan.layer, tokens)
    if columns is None:
        return None
    cache_layer, keys, values, start = columns
    length = start + tokens
    if mask is not None:
        kind = cpu_attention.mask_kind(mask)
        if kind is None or not mask.is_cpu or mask.dim() > 4:
            return None
    try:
        mask, mask_strides = cpu_attention.broadcast_mask(mask, batch, plan.layer.heads, tokens, length)
    except RuntimeError:
        return None
    causal = cpu_attention.causal(tokens, mask, plan.causal)
    step = array.array(
        "q",
        (
            batch,
            tokens,
            start,
            *keys.stride()[:3],
            *values.stride()[:3],
            0 if mask is None else kind,
            *mask_strides,
            causal,
            cos.stride(0) if cos.shape[0] > 1 else 0,
            cos.stride(1),
        ),
    )
    out = torch.empty_like(x)
    done = _ENTRY(
        ctypes.byref(plan.layer),
        x.data_ptr(),
        out.data_ptr(),
        step.buffer_info()[0],
        None if mask is None else mask.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        torch.get_num_threads(),
    )
    if not done:
        raise RuntimeError("hfspec's layer kernel refused a linear its plan accepted: a bug in hfspec.cpu.layer")
    cache_layer.advance(tokens)
    return out


def _columns(cache: object, index: int, batch: int, layer: _Layer, tokens: int):
    """The cache layer, its key and value buffers with room for ``tokens`` more columns and where they start; None
    where this is not hfspec's buffered cache, written before, in float32 of the layer's shape."""
    layers = getattr(cache, "layers", None)
    if layers is None or getattr(cache, "offloading", False) or index >= len(layers):
        return None
    cache_layer = layers[index]
    room = getattr(cache_layer, "room", None)
    found = None if room is None else room(tokens)
    if found is None:
        return None
    keys, values, start = found
    shape = (batch, layer.kv_heads)
    if (
        keys.dtype is not torch.float32
        or values.dtype is not torch.float32
        or keys.shape[:2] != shape
        or values.shape[:2] != shape
        or keys.shape[-1] != layer.head_dim
        or values.shape[-1] != layer.head_dim
        or keys.stride(-1) != 1
        or values.stride(-1) != 1
        or not keys.is_cpu
    ):
        return None
    return cache_layer, keys, values, start


@functools.cache
def _lean_class(kind: type) -> type:
    return type(f"Lean{kind.__name__}", (LeanLayer, kind), {"__module__": __name__})


def bind(library: kernels.KernelLibrary) -> None:
    """Bind the kernel entry of a loaded library (idempotent)."""
    global _ENTRY
    if _ENTRY is None:
        ptr = ctypes.c_void_p
        _ENTRY = library.function(
            "hfspec_layer", [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int], ctypes.c_int
        )


def use(model: nn.Module, library: kernels.KernelLibrary) -> int:
    """Switch ``model``'s Llama-like decoder layers to :class:`LeanLayer`; how many run it now."""
    bind(library)
    count = 0
    for module in model.modules():
        if isinstance(module, LeanLayer):
            count += 1
        elif _decoder_forward(type(module)) and _parts(module) is not None:
            module.__dict__["hfspec_original"] = type(module)
            module.__class__ = _lean_class(type(module))
            count += 1
    return count


def unuse(model: nn.Module) -> int:
    """Switch ``model``'s decoder layers back to their own classes; how many were switched."""
    count = 0
    for module in model.modules():
        if isinstance(module, LeanLayer):
            module.__class__ = module.__dict__.pop("hfspec_original")
            module.__dict__.pop("hfspec_plan", None)
            count += 1
    return count
