"""The runner's side of speculative decoding's draft trees (:mod:`tripath.engine.speculative.trees`): which
backends verify them, and moving an accepted path's cache rows to its positions.

A step of decodes and tree verifies alone replays a verify graph captured with tree masks
(:mod:`tripath.engine.runner.verify_graphs`); a tree step beside prompt tokens replays the piecewise prompt-step
graphs where they are captured (:mod:`tripath.engine.runner.mixed_graphs`: attention runs between them on the
step's own metadata, masks included), else it runs eagerly. The backend reads the verifies' ``tree_mask`` from
``metadata.decode.verify`` (``Capabilities.draft_trees``: ``three_path`` through :func:`tripath.ops.paged_verify`,
the MLA backends through :func:`tripath.ops.mla_verify`, and the ``torch`` reference), so the verifies must
sit in its decode slice (``decode_threshold = 1 + num_speculative_tokens``). Under tensor parallelism rank 0
decides the paths and hands the slots it moved to the workers, which move the same slots in their caches
(:mod:`tripath.engine.runner.worker`).
"""

from __future__ import annotations

import torch

from tripath.attention.step_ints import to_device
from tripath.engine.speculative.trees import path_moves
from tripath.ops.kv_cache import copy_cache_slots


def check_draft_trees(backend, spec, verify_len: int) -> None:
    """Refuse draft trees (``tree_width > 1``) on a backend whose verify route takes no tree mask, naming it."""
    why = None
    if not backend.capabilities.draft_trees:
        why = "its verify route takes no draft tree's mask"
    elif spec.decode_threshold != verify_len:
        why = f"verifies of {verify_len} tokens do not take its decode path (decode_threshold {spec.decode_threshold})"
    if why is not None:
        raise ValueError(f"speculative_config tree_width > 1 (draft trees) is not supported by the {backend.name} "
                         f"backend: {why}; use backend 'three_path' ('mla' for MLA models, or 'torch'), or "
                         "tree_width 1")


def move_tree_paths(caches, inputs, paths: list[list[int]], share=None) -> None:
    """Copy each verify's accepted nodes' K/V (``paths[b]``: its accepted nodes by depth), in every layer's
    cache, from the slots of their rows to those of their positions, on the device: a row ``r`` of the verify
    starting at token ``inputs.verify_starts[b]`` has slot ``inputs.slot_mapping[start + r]``. ``share(sources,
    targets)``: handed the slots moved (int64, on the device) when any row moved (rank 0 of tensor
    parallelism: to the workers)."""
    moves = [(start + a, start + b) for start, path in zip(inputs.verify_starts, paths) for a, b in path_moves(path)]
    if not moves:
        return
    slots = inputs.slot_mapping.index_select(
        0, to_device([a for a, _ in moves] + [b for _, b in moves], torch.int64, inputs.slot_mapping.device))
    sources, targets = slots[:len(moves)], slots[len(moves):]
    move_cache_slots(caches, sources, targets)
    if share is not None:
        share(sources, targets)


def move_cache_slots(caches, sources: torch.Tensor, targets: torch.Tensor) -> None:
    """Copy slot ``sources[i]``'s K/V to slot ``targets[i]`` in every layer's cache (int64 slots on the cache's
    device; a tensor-parallel worker makes rank 0's moves with them)."""
    for cache in caches:
        if hasattr(cache, "kv_cache"):   # MLA: one latent row a slot
            copy_cache_slots(cache.kv_cache, None, sources, targets)
        else:
            copy_cache_slots(cache.k_cache, cache.v_cache, sources, targets, layout=cache.layout)
