"""Loading a GGUF causal LM with its quantized blocks kept, for hfspec's quantized CPU kernel.

transformers loads a GGUF by dequantizing every tensor (the ``gguf`` package's numpy dequantization, then
``.to(dtype)``): a 1.1 GB Q4_K_M file becomes 7 GB of fp32. :func:`load` builds the same model (transformers'
config for the file, its architecture, its GGUF-to-transformers tensor names and per-architecture processing)
without that copy: the file is memory-mapped, and every linear and embedding stored in a format the kernel reads
(:data:`hfspec.cpu.quant.FORMATS`) becomes a :class:`~hfspec.cpu.quant.QuantLinear` or
:class:`~hfspec.cpu.quant.QuantEmbedding` over its blocks as stored. Everything else (norms, biases, tensors of
other formats) is dequantized exactly as transformers does it and cast to the activation dtype. A row permutation
transformers applies to a quantized weight (Llama's q/k heads) is applied to whole rows of blocks. With the kernel
on and float32 activations, the model's every output equals that of the same file loaded with transformers
(``dtype=torch.float32``) and run on hfspec's fp32 kernel, bit for bit.

Where the blocks cannot be kept -- the kernel is off or cannot be built, an architecture transformers converts
with value transforms or through its newer GGUF path, a transformers without the GGUF helpers used here -- it
returns None and says why in one log line; the caller then loads the file dequantized, as transformers does.
"""

from __future__ import annotations

import logging
import struct
import warnings
from collections import Counter
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.initialization import no_init_weights

from hfspec.cpu import quant
from hfspec.cpu.int8 import check_arithmetic
from hfspec.errors import HfspecError
from hfspec.models import gguf_meta

__all__ = ["GgufTensor", "file_problem", "load", "local_file", "read_tensors", "resolve_file"]

log = logging.getLogger(__name__)

# GGUF metadata value types of fixed size (the GGUF spec): u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_F32, _F16, _BF16 = 0, 1, 30


class GgufTensor:
    """One tensor of a GGUF file: name, ggml type, torch-order shape, and its bytes in the file's memory map
    (``rows``: a (rows, bytes per row) uint8 view)."""

    def __init__(self, name: str, ggml_type: int, shape: tuple[int, ...], data: np.ndarray):
        self.name, self.ggml_type, self.shape = name, ggml_type, shape
        self.rows = data.reshape(prod(shape[:-1]) if len(shape) > 1 else 1, -1)


def _string(blob: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(blob: memoryview, pos: int, kind: int) -> tuple[Any, int]:
    """The value of metadata type ``kind`` at ``pos`` (scalars and strings; arrays are skipped) and where it ends."""
    if kind in _SIZES:
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[_SIZES[kind]]
        return struct.unpack_from(fmt, blob, pos)[0], pos + _SIZES[kind]
    if kind == _STRING:
        return _string(blob, pos)
    if kind == _ARRAY:
        inner, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if inner in _SIZES:
            return None, pos + count * _SIZES[inner]
        if inner == _STRING:  # a vocabulary: skipped by its lengths, not decoded (150k tokens in a second less)
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
            return None, pos
        for _ in range(count):
            _, pos = _value(blob, pos, inner)
        return None, pos
    raise HfspecError(f"GGUF metadata value of unknown type {kind}")


def _header(path: str | Path, blob: np.ndarray) -> tuple[dict[str, Any], list[tuple[str, int, tuple, int, int]], int]:
    """``(metadata, table, data start)`` of a GGUF file (v2 or v3): each table entry is (name, ggml type, torch-order
    shape, offset from the data start, bytes)."""
    if bytes(blob[:4]) != b"GGUF":
        raise HfspecError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise HfspecError(f"{path} is GGUF v{version}; hfspec reads v2 and v3")
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    header = memoryview(blob)  # parsed through one view: a numpy slice per field cost ~0.4 s on a vocabulary
    pos, meta = 24, {}
    for _ in range(n_kv):
        key, pos = _string(header, pos)
        (kind,) = struct.unpack_from("<I", header, pos)
        meta[key], pos = _value(header, pos + 4, kind)
    table = []
    for _ in range(n_tensors):
        name, pos = _string(header, pos)
        (dims,) = struct.unpack_from("<I", header, pos)
        shape = tuple(reversed(struct.unpack_from(f"<{dims}Q", header, pos + 4)))
        ggml_type, offset = struct.unpack_from("<IQ", header, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        table.append((name, ggml_type, shape, offset, prod(shape) // block * size))
    align = meta.get("general.alignment") or 32
    return meta, table, (pos + align - 1) // align * align


def read_tensors(path: str | Path) -> tuple[str, list[GgufTensor]]:
    """``(architecture, tensors)`` of a GGUF file (v2 or v3), its tensor data memory-mapped, not read."""
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    meta, table, start = _header(path, blob)
    tensors = [
        GgufTensor(name, ggml_type, shape, blob[start + offset : start + offset + nbytes])
        for name, ggml_type, shape, offset, nbytes in table
    ]
    return str(meta.get("general.architecture", "")), tensors


def file_problem(path: str | Path) -> str | None:
    """Why the file at ``path`` is not a whole GGUF model (empty, not GGUF, a version hfspec does not read, its
    header or tensor data cut short), in words that follow "is"; None where it is one. Reads the header only."""
    size = Path(path).stat().st_size
    if size == 0:
        return "an empty file, not a model"
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return "not a model: a file, but not a GGUF file (it does not begin with the GGUF magic bytes)"
    try:
        _, table, start = _header(path, np.memmap(path, mode="r", dtype=np.uint8))
    except HfspecError as exc:  # a version hfspec does not read, a metadata type it does not know
        return f"not a GGUF model hfspec reads ({str(exc).removeprefix(f'{path} ')})"
    except (struct.error, ValueError, KeyError, UnicodeDecodeError, OverflowError):  # the header runs past the end
        return f"a truncated or damaged GGUF file (its header does not fit in its {size:,} bytes)"
    end = max((start + offset + nbytes for _, _, _, offset, nbytes in table), default=start)
    if end > size:
        return f"a truncated GGUF file (its tensor data ends at byte {end:,}, the file has {size:,} bytes)"
    return None


def local_file(source: str, gguf_file: str) -> str | None:
    """The path of ``gguf_file`` (a path itself, or a file in the directory ``source``) if it is on this machine."""
    for candidate in (Path(gguf_file), Path(source).expanduser() / gguf_file):
        if candidate.is_file():
            return str(candidate)
    return None


def resolve_file(source: str, gguf_file: str, revision: str | None = None) -> str:
    """The local path of ``gguf_file`` in the directory or hub repository ``source`` (or a path itself), as
    transformers resolves it (downloading it into the hub cache if need be)."""
    local = local_file(source, gguf_file)
    if local is not None:
        return local
    from transformers.utils import cached_file

    found = cached_file(source, gguf_file, revision=revision)
    if found is None:
        raise HfspecError(f"no GGUF file {gguf_file!r} in {source!r}")
    return found


def _helpers() -> tuple[Any, Any, dict, Any] | str:
    """transformers' GGUF name mapping and tensor processors, or why they are not there."""
    try:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            LlamaTensorProcessor,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )
    except ImportError as exc:
        return f"this transformers has no GGUF tensor mapping hfspec can use ({exc})"
    return get_gguf_hf_weights_map, TensorProcessor, TENSOR_PROCESSORS, LlamaTensorProcessor


def _newer_path(architecture: str) -> bool:
    """Whether transformers loads this architecture through its newer GGUF path (its own conversions)."""
    try:
        from transformers.integrations.gguf import is_gguf_arch_supported
    except ImportError:
        return False
    return bool(is_gguf_arch_supported(architecture))


def _dequantized(tensor: GgufTensor) -> np.ndarray:
    """The tensor's values as transformers gets them: the gguf package's dequantization, in float32."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(tensor.rows, GGMLQuantizationType(tensor.ggml_type)).reshape(tensor.shape)


def _row_order(processor: Any, tensor: GgufTensor, names: dict[str, str]) -> np.ndarray | None:
    """The rows of a quantized weight as transformers' processor orders them (None: as stored), found by passing
    it the row indices; an error where the processor does more to the weight than reorder its rows."""
    rows = tensor.shape[0]
    probe = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    out = np.asarray(
        processor.process(weights=probe, name=tensor.name, tensor_key_mapping=names, parsed_parameters={}).weights
    ).reshape(-1)
    if out.shape != (rows,) or not np.array_equal(np.sort(out), probe[:, 0]):
        raise HfspecError(
            f"transformers transforms {tensor.name} beyond reordering its rows; load it with gguf_native=False"
        )
    return None if np.array_equal(out, probe[:, 0]) else out


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def load(
    source: str,
    gguf_file: str,
    role: str,
    *,
    dtype: torch.dtype | str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
    arithmetic: str = "float32",
) -> PreTrainedModel | None:
    """The causal LM in ``gguf_file`` (inside the directory or repository ``source``) with its quantized linears and
    embeddings kept in blocks, or None (one log line says why) where they cannot be.

    Activations, norms and biases are float32 (``dtype`` ``"auto"`` or float32; another float dtype is honoured,
    but exactness against the dequantized model is stated for float32). ``arithmetic`` is what the quantized linears
    compute, the tied head included: ``"float32"``, the dequantized model's products; ``"int8"``, llama.cpp's
    integer arithmetic on the blocks (:mod:`hfspec.cpu.int8`), a slightly different model that every row computes
    alike. Embedding lookups return the dequantized rows in both.
    """
    check_arithmetic(arithmetic)
    why = quant.unavailable()
    helpers = _helpers() if why is None else why
    if isinstance(helpers, str):
        log.info(
            "%s %s: keeping GGUF blocks needs hfspec's quantized kernel (%s); loading it dequantized",
            role,
            gguf_file,
            helpers,
        )
        return None
    weights_map, base_processor, processors, llama_processor = helpers
    quant.kernel()
    path = resolve_file(source, gguf_file, revision)
    architecture, tensors = read_tensors(path)
    processor_class = processors.get(architecture, base_processor)
    if _newer_path(architecture) or processor_class not in (base_processor, llama_processor):
        log.info(
            "%s %s: transformers converts %s GGUF tensors with its own transforms, which hfspec does not "
            "apply to blocks; loading it dequantized",
            role,
            gguf_file,
            architecture,
        )
        return None
    act = torch.float32 if dtype in ("auto", None) else dtype
    config = gguf_meta.config(
        path,
        lambda: AutoConfig.from_pretrained(
            source, gguf_file=gguf_file, revision=revision, trust_remote_code=trust_remote_code
        ),
    )
    import accelerate

    # Parameters on meta, buffers (rotary) computed; no weight initialisation (as transformers' own from_pretrained):
    # initialising meta parameters ran torch's Python reference of normal_ per layer, a second of a 135M model's load.
    with accelerate.init_empty_weights(include_buffers=False), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=act, trust_remote_code=trust_remote_code)
    processor = processor_class(config=config.to_dict())
    names = gguf_meta.names(path, lambda: weights_map(model, processor))
    kept: Counter[str] = Counter()
    dequantized: Counter[str] = Counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for tensor in tensors:
            name = names.get(tensor.name)
            if name is None:
                continue
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            fmt = quant.format_of(tensor.ggml_type)
            if (
                fmt is not None
                and leaf == "weight"
                and type(module) in (nn.Linear, nn.Embedding)
                and tensor.shape[-1] % fmt.elements == 0
            ):
                order = _row_order(processor, tensor, names)
                # Rows gathered by numpy: torch's row gather of uint8 took 40 ms a tensor, numpy's 0.1 ms.
                blocks = torch.from_numpy(tensor.rows if order is None else np.take(tensor.rows, order, axis=0))
                if type(module) is nn.Linear:
                    replacement = quant.QuantLinear(blocks, fmt, module.in_features, module.bias, arithmetic)
                else:
                    replacement = quant.QuantEmbedding(blocks, fmt, module.embedding_dim, act, arithmetic)
                model.set_submodule(module_name, replacement)
                kept[fmt.name] += 1
                continue
            if tensor.ggml_type not in (_F32, _F16, _BF16):
                from gguf import GGMLQuantizationType

                dequantized[GGMLQuantizationType(tensor.ggml_type).name] += 1
            values = processor.process(
                weights=_dequantized(tensor), name=tensor.name, tensor_key_mapping=names, parsed_parameters={}
            ).weights
            _set_tensor(model, name, torch.from_numpy(np.copy(values)).to(act))
    if dequantized:
        log.info(
            "%s %s: no quantized kernel for %s; dequantized those at load",
            role,
            gguf_file,
            ", ".join(f"{n} {k}" for k, n in sorted(dequantized.items())),
        )
    _tie_head(model)
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise HfspecError(
            f"the {role} {str(source)!r} lacks {len(missing)} weight(s) that transformers would "
            f"initialise at random ({shown}): {gguf_file} is incomplete; pass a complete GGUF file"
        )
    model.config.name_or_path = source
    log.info(
        "%s %s: kept in GGUF blocks (%s), %s arithmetic",
        role,
        gguf_file,
        ", ".join(f"{n} {k}" for k, n in sorted(kept.items())),
        arithmetic,
    )
    return model.eval()


def _tie_head(model: PreTrainedModel) -> None:
    """A head tied to a quantized embedding reads the embedding's blocks; any other tie is transformers'."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False) or head is None:
        return
    if isinstance(embedding, quant.QuantEmbedding) and type(head) is nn.Linear and head.weight.is_meta:
        bias = None if head.bias is None else head.bias
        model.set_output_embeddings(
            quant.QuantLinear(embedding.weight, embedding.fmt, embedding.embedding_dim, bias, embedding.arithmetic)
        )
    elif type(head) is nn.Linear and head.weight.is_meta:
        model.tie_weights()
