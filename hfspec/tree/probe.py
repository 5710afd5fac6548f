"""Whether a model reads a draft tree exactly: one small tree forward checked against chain forwards.

A tree is verified in one forward through a prepared 4-D attention mask and explicit position ids
(``hfspec.models.adapter.tree_attention``). Attention modules that take those as they are read the tree as
its paths; one that rebuilds its own mask or positions (an ALiBi bias, positions counted from the
mask, a kernel that ignores the mask) would not, and would give wrong logits without an error. So
before a model verifies its first tree, :func:`reads_trees` runs a four-node tree after a short
context and compares each node's logits with those of a chain forward along its own path. A model
that fails keeps chains: ``tree="auto"`` never offers it a tree, and an explicit budget is refused.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hfspec.models.adapter import forward, sliding_window, takes_mask_mapping
from hfspec.models.kv_cache import KVState
from hfspec.tree.proposal import ancestry

# The probe: a context, then the pending token (the root) with children x and y, and z under x.
_CONTEXT = (5, 6, 7)
_NODES = (8, 9, 10, 11)  # root, x, y, z
_PARENTS = (-1, 0, 0, 1)  # within the fed block: x and y under the root, z under x
_DEPTHS = (0, 1, 1, 2)
_PATHS = {0: (0,), 1: (0, 1), 2: (0, 2), 3: (0, 1, 3)}  # each node's path from the root, as fed indices


@torch.inference_mode()
def reads_trees(model: PreTrainedModel) -> bool:
    """True when ``model``'s logits for every node of a small tree equal a chain forward along that node's path
    (within the arithmetic's own noise: a wrong mask moves them by whole units)."""
    device = model.get_output_embeddings().weight.device
    vocab = model.get_output_embeddings().weight.shape[0]
    context = torch.tensor([_CONTEXT], device=device) % vocab
    nodes = torch.tensor([_NODES], device=device) % vocab
    n = context.shape[1]
    kv = KVState(1, device, model)
    forward(model, context, kv.extend_mask(torch.ones_like(context)), torch.arange(n, device=device)[None], kv.cache)
    kv.extend_mask(torch.ones_like(nodes))
    positions = n + torch.tensor([_DEPTHS], device=device)
    visible = ancestry(torch.tensor([_PARENTS], device=device))
    window = sliding_window(model) if takes_mask_mapping(model) else None
    tree_logits = forward(
        model, nodes, kv.tree_attention(model, visible, positions, positions, window), positions, kv.cache
    )[0]
    scale = 1e-3 if tree_logits.dtype == torch.float32 and model.dtype == torch.float32 else 3e-2
    for node, path in _PATHS.items():
        chain = torch.cat([context, nodes[:, list(path)]], dim=1)
        fresh = KVState(1, device, model)
        logits = forward(
            model,
            chain,
            fresh.extend_mask(torch.ones_like(chain)),
            torch.arange(chain.shape[1], device=device)[None],
            fresh.cache,
        )[0, -1]
        if not torch.allclose(tree_logits[node], logits, rtol=0.0, atol=scale * max(1.0, float(logits.abs().max()))):
            return False
    return True
