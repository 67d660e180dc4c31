"""Arguments the kernels do not let Triton specialise on: values that change from one engine step to the next.

Triton compiles one variant of a kernel per *specialisation*: every constexpr value and, unless told
otherwise, whether each integer argument is 1 or a multiple of 16 and whether each pointer is 16-byte
aligned. Arguments that follow a step's batch (request counts, the block table's width, offsets of slices
of the step's metadata) would otherwise compile a new variant in the middle of serving. Every kernel is
declared with ``@triton.jit(**STEP_INVARIANT)`` (Gluon: ``@gluon.jit(**STEP_INVARIANT)``); names a kernel
does not have are ignored.

- :data:`STEP_INTS`: integers that vary per step. Left unspecialised they cost nothing measurable (they
  enter address arithmetic once per program).
- :data:`STEP_INDEX_POINTERS`: int32/int64 index tensors that the engine hands over as slices of packed
  per-step buffers, and the scalar or per-head operands (scales, ALiBi slopes, sinks) for which a launcher
  passes one of those slices as a placeholder when the feature is off. All are read one element at a time,
  so 16-byte alignment buys no wider loads.
"""

STEP_INTS = ("stride_bt", "num_seqs", "num_m_blocks", "num_splits", "fill_splits", "min_split_tiles", "num_tokens",
             "batch", "num_rows", "kv_split", "num_q_rows")
STEP_INDEX_POINTERS = ("block_table_ptr", "seq_lens_ptr", "cu_seqlens_ptr", "cu_seqlens_q_ptr", "cu_seqlens_k_ptr",
                       "q_start_ptr", "seq_starts_ptr", "splits_used_ptr", "slot_mapping_ptr", "positions_ptr",
                       "context_lens_ptr", "tree_mask_ptr", "k_scale_ptr", "v_scale_ptr", "kv_scale_ptr",
                       "q_scale_ptr", "scale_ptr", "alibi_ptr", "sinks_ptr", "temperature_ptr", "seeds_ptr")
STEP_INVARIANT = dict(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=STEP_INDEX_POINTERS)
