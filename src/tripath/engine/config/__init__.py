"""The engine's settings: :class:`EngineConfig` (``engine_config.py``: how the engine batches, caches and runs;
the dtype and device names it takes) and :class:`SpeculativeConfig` (``speculative.py``: speculative decoding,
as vLLM takes it). What every other part of the engine reads; it reads only a request's vocabulary
(:mod:`tripath.engine.requests`: the structured outputs' defaults).
"""

from tripath.engine.config.engine_config import (CPU_DEFAULT_KV_BLOCKS, DEFAULT_CPU_TARGET_S, DEFAULT_GRAMMAR_CACHE_MB,
                                                 DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DTYPES, EngineConfig,
                                                 resolve_device, resolve_dtype)
from tripath.engine.config.speculative import SpeculativeConfig

__all__ = [
    "EngineConfig", "SpeculativeConfig", "DTYPES", "resolve_dtype", "resolve_device", "CPU_DEFAULT_KV_BLOCKS",
    "DEFAULT_CPU_TARGET_S", "DEFAULT_GRAMMAR_CACHE_MB", "DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S",
]
