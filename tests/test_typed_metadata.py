"""The backends' own metadata (``TwoPathMetadata``, ``ThreePathMetadata``, ``MLAMetadata``): built in ``build_metadata``, copied in
place by ``copy_`` (CUDA-graph replay copies a step's metadata into the captured one of the same padded
shape) and checked by the validator. Expected values are computed here from the plans' host lists."""

from itertools import accumulate

import pytest
import torch

from tripath.attention import AttentionSpec, MLASpec, plan_batch, select_backend
from tripath.attention.backends.mla_common import MLAMetadata
from tripath.attention.backends.three_path import ThreePathMetadata
from tripath.attention.backends.two_path import TwoPathMetadata
from tripath.attention.validate import MetadataError, validate_metadata

BLOCK = 4
NUM_BLOCKS = 40
MHA = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=BLOCK)
MLA = AttentionSpec(4, 1, 80, dtype=torch.float16, block_size=BLOCK, decode_threshold=3,
                    mla=MLASpec(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32))


def _step(backend, query_lens, context_lens, width, seed):
    """The backend's metadata of one step: a random block table ``[B, width]`` of distinct block ids and
    padding slots (−1: nothing written, so any table is consistent with them)."""
    plan = backend.plan(query_lens, context_lens)
    assert plan.order == list(range(len(query_lens)))  # given in plan order: rows below are the arguments'
    g = torch.Generator().manual_seed(seed)
    table = (torch.randperm(NUM_BLOCKS - 1, generator=g)[:len(query_lens) * width] + 1).to(torch.int32)
    slots = torch.full((plan.num_tokens,), -1, dtype=torch.int64)
    return backend.build_metadata(plan, table.view(len(query_lens), width), slots)


def _offsets(lens):
    return [0, *accumulate(lens)]


def test_two_path_context_offsets_built_once_and_copied_into_the_captured_metadata():
    backend = select_backend(MHA, "two_path", "cpu")
    # Same padded shape (2 decodes, then 2 prefills, 10 tokens), different query lengths.
    captured = _step(backend, [1, 1, 5, 3], [4, 6, 0, 0], width=5, seed=0)
    step = _step(backend, [1, 1, 2, 6], [9, 2, 0, 0], width=3, seed=1)
    assert isinstance(captured, TwoPathMetadata) and isinstance(step, TwoPathMetadata)
    assert step.context_cu_seqlens_q.tolist() == _offsets([2, 6])  # from build_metadata, before any forward
    kept = captured.context_cu_seqlens_q
    captured.copy_(step)
    assert captured.context_cu_seqlens_q is kept  # in place: a captured graph reads this tensor
    assert kept.tolist() == _offsets([2, 6])
    assert captured.cu_seqlens_q.tolist() == _offsets([1, 1, 2, 6])
    validate_metadata(step, NUM_BLOCKS, BLOCK)
    decodes_only = _step(backend, [1, 1], [3, 8], width=3, seed=2)
    assert decodes_only.context_cu_seqlens_q is None
    validate_metadata(decodes_only, NUM_BLOCKS, BLOCK)
    with pytest.raises(ValueError, match=r"metadata.context_cu_seqlens_q is set in the step but None in the "
                                         r"captured metadata"):
        _step(backend, [1, 1, 1], [3, 8, 2], width=3, seed=3).copy_(_step(backend, [1, 1, 1], [3, 8, 0],
                                                                          width=3, seed=3))
    step.context_cu_seqlens_q[1] += 1
    with pytest.raises(MetadataError, match=r"metadata.context_cu_seqlens_q is \[0, 3, 8\], expected the "
                                            r"offsets \[0, 2, 8\]"):
        validate_metadata(step, NUM_BLOCKS, BLOCK)


def test_three_path_joined_prompt_launch_metadata():
    """Extends of one context chunk beside prefills get the joined launch's offsets (each extend's whole
    sequence, then each prefill's new tokens); a step without prefills, or whose extends take several
    chunks, gets none. The validator checks the offsets against the plan."""
    backend = select_backend(MHA, "three_path", "cpu")
    step = _step(backend, [1, 3, 2, 5, 4], [6, 5, 2, 0, 0], width=4, seed=0)  # 1 decode, 2 extends, 2 prefills
    assert isinstance(step, ThreePathMetadata) and step.plan.extend_chunks.num_chunks == 1
    assert step.prompts.cu_seqlens_k.tolist() == _offsets([8, 4, 5, 4])
    assert step.prompts.seq_starts.tolist() == [0, 0, 0, 0]
    assert step.prompts.q_positions_start.tolist() == [5, 2, 0, 0]
    assert step.prompts_cu_seqlens_q.tolist() == _offsets([3, 2, 5, 4])
    assert (step.prompts.num_tokens, step.prompts.max_len) == (21, 8)
    validate_metadata(step, NUM_BLOCKS, BLOCK)
    assert _step(backend, [1, 3, 2], [6, 5, 2], width=4, seed=1).prompts is None  # no prefill
    assert _step(backend, [1, 5, 4], [6, 0, 0], width=4, seed=1).prompts is None  # no extend
    several = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=BLOCK, extend_chunk_budget=4)
    chunked = _step(select_backend(several, "three_path", "cpu"), [3, 5], [9, 0], width=4, seed=2)
    assert chunked.plan.extend_chunks.num_chunks > 1 and chunked.prompts is None
    step.prompts.q_positions_start[0] += 1
    with pytest.raises(MetadataError, match=r"metadata.prompts.q_positions_start must be each request's context "
                                            r"length"):
        validate_metadata(step, NUM_BLOCKS, BLOCK)


def _decode_rows(table, query_lens, context_lens):
    """Per decode token: its request's block-table row and ``context + i + 1``."""
    rows = [table[j].tolist() for j, q in enumerate(query_lens) for _ in range(q)]
    lens = [c + i + 1 for q, c in zip(query_lens, context_lens) for i in range(q)]
    return rows, lens


@pytest.mark.parametrize("name", ["mla", "mla_triton"])
def test_mla_decode_rows_built_and_copied_into_the_captured_metadata(name):
    backend = select_backend(MLA, name, "cpu")
    # Speculative decodes only, same padded shape (3 requests, 6 tokens), different lengths.
    captured = _step(backend, [1, 2, 3], [7, 5, 3], width=6, seed=0)   # one-token decodes before verifies
    step = _step(backend, [1, 3, 2], [9, 2, 4], width=4, seed=1)
    assert isinstance(captured, MLAMetadata) and isinstance(step, MLAMetadata)
    want_rows, want_lens = _decode_rows(step.block_table, [1, 3, 2], [9, 2, 4])
    assert step.decode_rows.block_table.tolist() == want_rows and step.decode_rows.seq_lens.tolist() == want_lens
    rows_table, rows_lens = captured.decode_rows.block_table, captured.decode_rows.seq_lens
    old_columns = rows_table[:, 4:].clone()
    captured.copy_(step)
    assert captured.decode_rows.block_table is rows_table and captured.decode_rows.seq_lens is rows_lens
    assert rows_table[:, :4].tolist() == want_rows and rows_lens.tolist() == want_lens
    assert torch.equal(rows_table[:, 4:], old_columns)  # past the step's width: kept (never read)
    validate_metadata(step, NUM_BLOCKS, BLOCK)
    single = _step(backend, [1, 1], [5, 3], width=3, seed=2)
    assert single.decode_rows is None
    validate_metadata(single, NUM_BLOCKS, BLOCK)
    step.decode_rows.seq_lens[0] += 1
    with pytest.raises(MetadataError, match=r"metadata.decode_rows.seq_lens is \[11, 3, 4, 5, 5, 6\], expected "
                                            r"\[10, 3, 4, 5, 5, 6\]"):
        validate_metadata(step, NUM_BLOCKS, BLOCK)
    step.decode_rows.seq_lens[0] -= 1
    step.decode_rows.block_table[3] = step.block_table[0]
    with pytest.raises(MetadataError, match=r"metadata.decode_rows.block_table row 3 is not request 1's row"):
        validate_metadata(step, NUM_BLOCKS, BLOCK)


def test_copy_refuses_metadata_of_another_backend():
    plan = plan_batch([1, 1], [5, 3], block_size=BLOCK)
    tables = (torch.ones(2, 2, dtype=torch.int32), torch.full((2,), -1, dtype=torch.int64))
    two_path = select_backend(MHA, "two_path", "cpu").build_metadata(plan, *tables)
    plain = select_backend(MHA, "unified", "cpu").build_metadata(plan, *tables)
    with pytest.raises(TypeError, match=r"metadata of type AttentionMetadata cannot be copied into the "
                                        r"captured TwoPathMetadata"):
        two_path.copy_(plain)
