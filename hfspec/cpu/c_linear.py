"""What a kernel-backed linear hands to code that calls its kernel from C: the entry and the arguments its forward gives.

A decoder layer run in one kernel call (:mod:`hfspec.cpu.layer`) calls each projection's entry itself. Each linear
class that runs hfspec's kernel says, through ``c_linear()``, which entry its forward would call on float32 CPU rows
and with what: a :class:`CLinear`, or None where its forward would do something else (the kernel off, another device,
a weight or bias it would convert first). The bits are then those of the module's own forward.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["CLinear", "Kind"]


class Kind(enum.IntEnum):
    """The entry (``hfspec/cpu/csrc/layer.cpp``'s ``Kind``)."""

    FLOAT32 = 1  # hfspec_linear_f32: float32 weights (FastLinear)
    GGUF_FLOAT32 = 2  # hfspec_quant_linear: GGUF blocks, float32 arithmetic (QuantLinear)
    INT8 = 3  # hfspec_int8_linear: GGUF blocks as stored, integer arithmetic (QuantLinear)
    INT8_PACKED = 4  # hfspec_int8_linear_packed: the same blocks repacked (QuantLinear)
    DRAFT = 5  # hfspec_draft_linear: the draft kernel's codes (DraftLinear)


@dataclass(frozen=True)
class CLinear:
    """One linear's kernel call: ``y = x @ W^T + bias`` for float32 rows x of ``k``, y of ``n``."""

    kind: Kind
    type: int  # the ggml type (GGUF kinds), the bits per code (DRAFT), else 0
    weight: torch.Tensor  # what the entry reads (kept alive with this record)
    ldw: int  # bytes or elements between weight rows, as the entry takes them (0 where it takes none)
    bias: torch.Tensor | None  # float32, contiguous
    n: int
    k: int
    plan: tuple[int, ...] = ()  # the block shape per row count (FLOAT32, GGUF_FLOAT32)
    max_rows: int | None = None  # more rows than this go elsewhere (FastLinear's max_rows)
