"""One decode step's metadata moved on by a token, on the device (multi-step decoding).

For each of the first ``n`` rows ``r``: ``p = positions[r] + 1`` is stored back, ``seq_lens[r]`` and
``context_lens[r]`` grow by one, and ``slot_mapping[r] = block_table[r, p // block_size] · block_size +
p % block_size``. One launch where the PyTorch graph of the same update runs eight.
"""

import triton
import triton.language as tl
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit(**STEP_INVARIANT)
def advance_decodes_kernel(
    positions_ptr, seq_lens_ptr, context_lens_ptr, block_table_ptr, slot_mapping_ptr,
    num_seqs, stride_bt, block_size,
    BLOCK: tl.constexpr,
):
    """Program ``p`` advances rows ``[p · BLOCK, (p + 1) · BLOCK)`` of the ``num_seqs`` rows."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < num_seqs
    position = tl.load(positions_ptr + rows, mask=ok, other=0) + 1
    tl.store(positions_ptr + rows, position, mask=ok)
    tl.store(seq_lens_ptr + rows, tl.load(seq_lens_ptr + rows, mask=ok, other=0) + 1, mask=ok)
    tl.store(context_lens_ptr + rows, tl.load(context_lens_ptr + rows, mask=ok, other=0) + 1, mask=ok)
    block = tl.load(block_table_ptr + rows.to(tl.int64) * stride_bt + position // block_size, mask=ok, other=0)
    tl.store(slot_mapping_ptr + rows, block.to(tl.int64) * block_size + position % block_size, mask=ok)
