"""Attention layer: specs, batch planning, per-step metadata, backends and their selection."""

from tripath.attention.context import AttentionContext, ForwardContext
from tripath.attention.layer_replay import WatchedPaths
from tripath.attention.metadata import AttentionMetadata, build_metadata
from tripath.attention.planner import BatchPlan, ExtendChunkPlan, classify, plan_batch, plan_extend_chunks
from tripath.attention.selector import BackendUnavailableError, default_block_size, explain, select_backend
from tripath.attention.spec import (AttentionSpec, KVCache, MLACache, MLALayerWeights, MLASpec,
                                    RotaryTables)

__all__ = [
    "AttentionSpec", "MLASpec", "KVCache", "MLACache", "MLALayerWeights", "RotaryTables",
    "BatchPlan", "ExtendChunkPlan", "classify", "plan_batch", "plan_extend_chunks",
    "AttentionMetadata", "build_metadata", "select_backend", "explain", "BackendUnavailableError",
    "default_block_size",
    "AttentionContext", "ForwardContext", "WatchedPaths",
]
