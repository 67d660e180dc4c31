"""Batch planning on hand-worked examples, metadata slices, and bad inputs."""

import pytest
import torch

from tripath.attention import build_metadata, classify, plan_batch, plan_extend_chunks


def test_classify():
    assert classify(1, 9) == "decode"
    assert classify(1, 0) == "prefill"  # no context: a one-token prompt is a prefill
    assert classify(2, 9) == "extend"
    assert classify(3, 9, decode_threshold=3) == "decode"  # speculative decode: 1 + 2 draft tokens
    assert classify(4, 9, decode_threshold=3) == "extend"


def test_order_is_stable_decode_extend_prefill():
    plan = plan_batch([1, 7, 1, 3, 5, 1], [9, 0, 4, 5, 0, 2])
    assert plan.order == [0, 2, 5, 3, 1, 4]
    assert (plan.num_decodes, plan.num_extends, plan.num_prefills) == (3, 1, 2)
    assert plan.query_lens == [1, 1, 1, 3, 7, 5]
    assert plan.context_lens == [9, 4, 2, 5, 0, 0]
    assert plan.seq_lens == [10, 5, 3, 8, 7, 5]
    assert plan.decode_tokens == (0, 3) and plan.extend_tokens == (3, 6) and plan.prefill_tokens == (6, 18)
    # original tokens: r0 [0], r1 [1..7], r2 [8], r3 [9..11], r4 [12..16], r5 [17]
    assert plan.token_order().tolist() == [0, 8, 17, 9, 10, 11, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15, 16]
    assert plan.apply(["a", "b", "c", "d", "e", "f"]) == ["a", "c", "f", "d", "b", "e"]


def test_verifies_follow_the_one_token_decodes():
    """[decode | verify | extend | prefill]: with decode_threshold 4, decodes of 2-4 tokens (speculative
    decoding's verifies) come after the one-token decodes, each group in the callers' order."""
    plan = plan_batch([3, 1, 7, 4, 1, 2, 5], [9, 4, 0, 5, 2, 6, 8], decode_threshold=4)
    assert plan.order == [1, 4, 0, 3, 5, 6, 2]
    assert (plan.num_decodes, plan.num_verifies, plan.num_extends, plan.num_prefills) == (5, 3, 1, 1)
    assert plan.query_lens == [1, 1, 3, 4, 2, 5, 7]
    assert plan_batch([1, 5], [3, 4]).num_verifies == 0   # threshold 1: the 5 tokens are an extend
    meta = build_metadata(plan, torch.ones(7, 4, dtype=torch.int32), torch.zeros(plan.num_tokens, dtype=torch.int64))
    v = meta.decode.verify
    assert (v.first_row, v.token_start, v.max_query_len) == (2, 2, 4)
    assert v.cu_seqlens_q.tolist() == [0, 3, 7, 9] and v.seq_lens.tolist() == [12, 9, 8]
    assert build_metadata(plan_batch([1, 1], [3, 4], decode_threshold=4), torch.ones(2, 1, dtype=torch.int32),
                          torch.zeros(2, dtype=torch.int64)).decode.verify is None


def test_extend_chunk_plan_hand_worked():
    # budget 64 shared by 3 extends -> 21 tokens each, rounded down to whole 16-token blocks -> 16.
    chunks = plan_extend_chunks([40, 10, 33], budget=64, block_size=16)
    assert chunks.chunk_size == 16 and chunks.num_chunks == 3
    assert chunks.starts == [[0, 0, 0], [16, 16, 16], [32, 32, 32]]
    assert chunks.lens == [[16, 10, 16], [16, 0, 16], [8, 0, 1]]
    assert chunks.cu_lens(2) == [0, 8, 8, 9]
    assert chunks.workspace_tokens == 42
    # a budget below one block per extend is used as it is
    small = plan_extend_chunks([5, 7], budget=6, block_size=16)
    assert small.chunk_size == 3 and small.lens == [[3, 3], [2, 3], [0, 1]]
    # default budget: one chunk for contexts that fit
    assert plan_extend_chunks([4096] * 8, budget=32768).num_chunks == 1
    assert plan_extend_chunks([100_000], budget=32768).num_chunks == 4


def test_metadata_slices_follow_the_plan():
    plan = plan_batch([1, 7, 1, 3], [9, 0, 4, 20], chunk_budget=16, block_size=4)
    table = torch.arange(4 * 8, dtype=torch.int32).view(4, 8)
    meta = build_metadata(plan, table, torch.arange(12, dtype=torch.int64))
    assert meta.seq_lens.tolist() == [10, 5, 23, 7]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 5, 12]
    assert meta.decode.num_reqs == 2 and meta.decode.single_token
    assert meta.decode.block_table.data_ptr() == table.data_ptr()
    e = meta.extend
    assert (e.token_start, e.token_end, e.max_context_len) == (2, 5, 20)
    assert e.cu_seqlens_q.tolist() == [0, 3]
    assert [c.seq_starts.tolist() for c in e.chunks] == [[0], [16]]
    assert [c.cu_seqlens_k.tolist() for c in e.chunks] == [[0, 16], [0, 4]]
    assert [c.q_positions_start.tolist() for c in e.chunks] == [[20], [4]]
    assert e.workspace_tokens == 16
    # the last chunk joined with the 3 new tokens: positions [16, 23)
    assert (e.tail.seq_starts.tolist(), e.tail.cu_seqlens_k.tolist(), e.tail.q_positions_start.tolist(),
            e.tail.max_len, e.tail_tokens) == ([16], [0, 7], [4], 7, 7)
    assert meta.prefill.cu_seqlens_q.tolist() == [0, 7] and meta.prefill.token_start == 5


def test_extend_tail_of_a_context_that_ended_in_an_earlier_chunk():
    """Contexts 40, 10, 33 in 16-token chunks: the last chunk starts at 32, after the second context ends,
    so that extend's tail is its new tokens alone (from position 10)."""
    plan = plan_batch([3, 5, 2], [40, 10, 33], chunk_budget=64, block_size=16)
    meta = build_metadata(plan, torch.zeros(3, 4, dtype=torch.int32), torch.arange(10, dtype=torch.int64))
    tail = meta.extend.tail
    assert tail.seq_starts.tolist() == [32, 10, 32]
    assert tail.cu_seqlens_k.tolist() == [0, 11, 16, 19]
    assert tail.q_positions_start.tolist() == [8, 0, 1]
    assert (tail.max_len, meta.extend.tail_tokens) == (11, 19)


@pytest.mark.parametrize("query_lens,context_lens,message", [
    ([1, 2], [0], "one entry per request"),
    ([0], [3], r"query_lens\[0\] = 0"),
    ([1], [-1], r"context_lens\[0\] = -1"),
])
def test_plan_rejects_bad_input(query_lens, context_lens, message):
    with pytest.raises(ValueError, match=message):
        plan_batch(query_lens, context_lens)


def test_metadata_rejects_bad_tables():
    plan = plan_batch([1, 2], [3, 0])
    with pytest.raises(TypeError, match="block_table must be"):
        build_metadata(plan, torch.zeros(2, 4, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="block_table has 1 rows for 2 requests"):
        build_metadata(plan, torch.zeros(1, 4, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"slot_mapping must be \[3\]"):
        build_metadata(plan, torch.zeros(2, 4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="slot_mapping must be int64"):
        build_metadata(plan, torch.zeros(2, 4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))


def test_metadata_copy_takes_a_narrower_block_table():
    """Graph replay: a step's block table as wide as its longest row is copied into the captured, wider
    table's first columns; the columns past it keep their values (never read); a wider one is refused."""
    plan = plan_batch([1, 1], [5, 9], block_size=4)
    slots = torch.full((2,), -1, dtype=torch.int64)
    captured = build_metadata(plan, torch.full((2, 6), 7, dtype=torch.int32), slots)
    step_table = torch.tensor([[3, 4, 0], [5, 6, 8]], dtype=torch.int32)
    captured.copy_(build_metadata(plan, step_table, slots))
    assert torch.equal(captured.block_table[:, :3], step_table)
    assert torch.equal(captured.block_table[:, 3:], torch.full((2, 3), 7, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"metadata.block_table: shape \(2, 7\) does not match the captured"):
        captured.copy_(build_metadata(plan, torch.zeros(2, 7, dtype=torch.int32), slots))
