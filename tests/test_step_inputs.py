"""The step's inputs built from the staging buffers and block-list mirrors match the definition (token
ids, positions, slots, block table, logit rows in plan order), step after step, also when a request's block
list grows in place or is replaced (preemption)."""

import random

import numpy as np
import torch

from tripath.attention.planner import plan_batch
from tripath.engine.request import Request, SamplingParams
from tripath.engine.scheduler import ScheduledRequest
from tripath.engine.step_inputs import StepInputBuilder

BS = 4


def expected(plan, scheduled, num_padding):
    """The inputs from their definition (module doc of tripath.engine.step_inputs), with plain Python."""
    ids, positions, slots, rows, logits, sample_rows = [], [], [], [], [], []
    for i in plan.order:
        if i >= len(scheduled):
            ids.append(0), positions.append(1), slots.append(-1), rows.append([])
            continue
        item = scheduled[i]
        blocks = item.request.block_ids
        for p in range(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens):
            ids.append(item.request.all_token_ids[p])
            positions.append(p)
            slots.append(blocks[p // BS] * BS + p % BS)
        rows.append(list(blocks))
        if item.samples:
            logits.append(len(ids) - 1)
            sample_rows.append(i)
    width = max(1, max(len(r) for r in rows))
    table = np.zeros((len(rows), width), dtype=np.int32)
    for r, blocks in enumerate(rows):
        table[r, :len(blocks)] = blocks
    return ids, positions, slots, table, logits, sample_rows


def test_inputs_match_their_definition_across_steps():
    rng = random.Random(0)
    builder = StepInputBuilder(torch.device("cpu"), BS, max_tokens=64, max_requests=8, max_blocks_per_seq=32)
    requests = [Request([rng.randrange(2, 100) for _ in range(rng.randrange(1, 30))], SamplingParams(max_tokens=50),
                        request_id=str(i)) for i in range(5)]
    next_block = iter(range(1, 10_000))
    for step in range(12):
        scheduled = []
        for request in requests:
            if rng.random() < 0.2:
                continue  # not scheduled this step
            if step == 6 and request.request_id in ("1", "3"):  # preempted: its list replaced, recomputed
                request.block_ids, request.num_computed_tokens = [], 0
            pending = request.num_tokens - request.num_computed_tokens
            new = min(pending, rng.randrange(1, 9)) if pending > 1 else 1
            total = request.num_computed_tokens + new
            while len(request.block_ids) * BS < total:
                request.block_ids.append(next(next_block))  # grows in place, as the block manager does
            scheduled.append(ScheduledRequest(request, new, request.num_computed_tokens))
        if not scheduled:
            continue
        padding = 2 if all(s.num_new_tokens == 1 and s.num_computed_tokens for s in scheduled) else 0
        plan = plan_batch([s.num_new_tokens for s in scheduled] + [1] * padding,
                          [s.num_computed_tokens for s in scheduled] + [1] * padding, block_size=BS)
        got = builder.build(plan, scheduled, padding)
        ids, positions, slots, table, logits, sample_rows = expected(plan, scheduled, padding)
        assert got.input_ids.tolist() == ids and got.positions.tolist() == positions
        assert got.slot_mapping.tolist() == slots and got.logit_indices.tolist() == logits
        assert np.array_equal(got.block_table.numpy(), table) and got.sample_rows == sample_rows
        for item in scheduled:  # advance as the scheduler's update does
            item.request.num_computed_tokens += item.num_new_tokens
            if item.samples:
                item.request.output_token_ids.append(rng.randrange(2, 100))
