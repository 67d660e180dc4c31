"""The step's inputs built from the staging buffers and block-list mirrors match the definition (token
ids, positions, slots, block table, logit rows in plan order), step after step, also when a request's block
list grows in place or is replaced (preemption), and when a decode's input token is still in flight (the
deferred rows name where it comes from in the launched step's tokens)."""

import random

import numpy as np
import pytest
import torch
from conftest import DEVICE

from tripath.attention.planner import plan_batch
from tripath.engine.requests.request import Request
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.runner.step_inputs import StepInputBuilder
from tripath.engine.scheduling.scheduler import ScheduledRequest

BS = 4


def expected(plan, scheduled, num_padding, inflight):
    """The inputs from their definition (module doc of tripath.engine.runner.step_inputs), with plain Python;
    ``inflight``: request id -> the value of its in-flight token."""
    ids, positions, slots, rows, logits, sample_rows = [], [], [], [], [], []
    for i in plan.order:
        if i >= len(scheduled):
            ids.append(0), positions.append(1), slots.append(-1), rows.append([])
            continue
        item = scheduled[i]
        blocks = item.request.block_ids
        tokens = item.request.all_token_ids + ([inflight[item.request.request_id]]
                                                if item.request.request_id in inflight else [])
        for p in range(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens):
            ids.append(tokens[p])
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
    inflight: dict[str, int] = {}                  # request id -> its in-flight token's value
    launched_rows: dict[int, int] = {}             # id(request) -> row of the launched step's tokens
    launched_tokens: list[int] = []
    num_deferred = 0
    for step in range(16):
        scheduled = []
        for request in requests:
            if rng.random() < 0.2:
                continue  # not scheduled this step
            if step == 6 and request.request_id in ("1", "3") and not request.num_inflight_tokens:
                request.block_ids, request.num_computed_tokens = [], 0  # preempted: list replaced, recomputed
            pending = request.num_pending_tokens
            new = min(pending, rng.randrange(1, 9)) if pending > 1 else 1
            total = request.num_computed_tokens + new
            while len(request.block_ids) * BS < total:
                request.block_ids.append(next(next_block))  # grows in place, as the block manager does
            scheduled.append(ScheduledRequest(request, new, request.num_computed_tokens,
                                              total == request.num_tokens + request.num_inflight_tokens))
        if not scheduled:
            continue
        padding = 2 if all(s.num_new_tokens == 1 and s.num_computed_tokens for s in scheduled) else 0
        plan = plan_batch([s.num_new_tokens for s in scheduled] + [1] * padding,
                          [s.num_computed_tokens for s in scheduled] + [1] * padding, block_size=BS)
        got = builder.build(plan, scheduled, padding, launched_rows)
        ids, positions, slots, table, logits, sample_rows = expected(plan, scheduled, padding, inflight)
        got_ids = got.input_ids.clone()
        if got.deferred is not None:
            rows, sources = got.deferred
            got_ids[rows] = torch.tensor(launched_tokens)[sources]
            num_deferred += rows.numel()
        assert got_ids.tolist() == ids and got.positions.tolist() == positions
        assert got.slot_mapping.tolist() == slots and got.logit_indices.tolist() == logits
        assert np.array_equal(got.block_table.numpy(), table) and got.sample_rows == sample_rows
        for request in requests:  # the launched step's tokens are read
            if request.num_inflight_tokens:
                request.output_token_ids.append(inflight.pop(request.request_id))
                request.num_inflight_tokens = 0
        launched_rows, launched_tokens = {}, []
        for item in scheduled:  # advance as the scheduler does; half the new tokens stay in flight
            item.request.num_computed_tokens += item.num_new_tokens
            if item.samples:
                token = rng.randrange(2, 100)
                if rng.random() < 0.5:
                    inflight[item.request.request_id] = token
                    item.request.num_inflight_tokens = 1
                    launched_rows[id(item.request)] = len(launched_tokens)
                    launched_tokens.append(token)
                else:
                    item.request.output_token_ids.append(token)
    assert num_deferred > 5


def test_a_decode_of_a_token_no_launched_step_samples_is_refused():
    builder = StepInputBuilder(torch.device("cpu"), BS, max_tokens=8, max_requests=2, max_blocks_per_seq=4)
    request = Request([5, 6, 7], SamplingParams(), request_id="r", block_ids=[1], num_computed_tokens=3,
                      num_inflight_tokens=1)
    plan = plan_batch([1], [3], block_size=BS)
    with pytest.raises(RuntimeError, match="no launched step is sampling"):
        builder.build(plan, [ScheduledRequest(request, 1, 3, True)], 0, {})


def test_block_rows_kept_across_steps_stay_bounded_and_exact():
    """The builder keeps each scheduled block list in a row across steps: over many steps of requests coming,
    going, growing in place, being replaced and sharing one list, every table equals the definition and the
    store never holds more rows than a step schedules."""
    rng = random.Random(1)
    builder = StepInputBuilder(torch.device("cpu"), BS, max_tokens=256, max_requests=6, max_blocks_per_seq=8)
    next_block = iter(range(1, 1_000_000))
    requests = []
    for step in range(300):
        requests = [r for r in requests if rng.random() > 0.1]   # some finish
        while len(requests) < 6:
            requests.append(Request([2] * rng.randrange(4, 24), SamplingParams(), request_id=str(step)))
        for request in requests:
            if not request.block_ids or rng.random() < 0.05:     # (re)allocated: a new list
                request.block_ids = [next(next_block) for _ in range(rng.randrange(1, 4))]
            elif rng.random() < 0.3 and len(request.block_ids) < 20:
                request.block_ids.extend(next(next_block) for _ in range(rng.randrange(1, 3)))
        chosen = [r for r in requests if rng.random() < 0.7] or requests[:1]
        if rng.random() < 0.2:
            chosen[-1].block_ids = chosen[0].block_ids   # two requests on one list
        scheduled = [ScheduledRequest(r, 1, 1, False) for r in chosen]
        plan = plan_batch([1] * len(scheduled), [1] * len(scheduled), block_size=BS)
        got = builder.build(plan, scheduled, 0, {})
        want = [list(scheduled[i].request.block_ids) for i in plan.order]
        width = max(len(row) for row in want)
        table = np.zeros((len(want), width), dtype=np.int32)
        for r, blocks in enumerate(want):
            table[r, :len(blocks)] = blocks
        assert np.array_equal(got.block_table.numpy(), table), step
        assert builder._blocks.rows.shape[0] <= 6 + 1


def _tensors(value, path="meta"):
    """Every tensor reachable from metadata ``value``, by its attribute path (plan and host ints left out)."""
    import dataclasses

    if isinstance(value, torch.Tensor):
        yield path, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if f.name != "plan":
                yield from _tensors(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{path}[{i}]")


@pytest.mark.parametrize("name", ["three_path", "two_path", "unified", "mla", "mla_triton"])
def test_the_metadata_integers_travel_with_the_block_table_and_equal_an_own_upload(name):
    """``backend.step_ints(plan)`` staged by the builder: the step's metadata integers reach the device in the
    block table's copy (one storage), and ``StepInputs.metadata`` equals the metadata the backend uploads on its
    own — for steps of one-token decodes, verifies, extends over several context chunks and prefills, and the
    backends' own integers (three_path's joined prompts, MLA's decode rows)."""
    from tripath.attention import AttentionSpec, select_backend
    from tripath.attention.spec import MLASpec

    mla = MLASpec(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32) \
        if name.startswith("mla") else None
    spec = AttentionSpec(4, 1 if mla else 2, 80 if mla else 64, dtype=torch.float16, block_size=BS,
                         extend_chunk_budget=24, decode_threshold=1 if name == "two_path" else 3, mla=mla)
    backend = select_backend(spec, name, DEVICE)
    builder = StepInputBuilder(DEVICE, BS, max_tokens=256, max_requests=16, max_blocks_per_seq=64)
    rng = random.Random(hash(name) % 1000)
    steps = [[(1, 30), (1, 7), (3, 12), (2, 5), (40, 50), (9, 3), (20, 0), (6, 0)],   # all classes, chunked
             [(25, 20), (30, 0)],                                                    # one chunk + prefill: joined
             [(1, 4), (1, 90), (3, 9)]]                                               # decodes and a verify
    for lens in steps:
        requests = []
        for q, c in lens:
            request = Request([rng.randrange(2, 100) for _ in range(q + c)], SamplingParams(max_tokens=4))
            request.block_ids = list(range(1 + 20 * len(requests), 1 + 20 * len(requests) + (q + c + BS) // BS))
            request.num_computed_tokens = c
            requests.append(ScheduledRequest(request, q, c, True))
        plan = backend.plan([q for q, _ in lens], [c for _, c in lens])
        inputs = builder.build(plan, requests, 0, ints=backend.step_ints(plan))
        got = inputs.metadata(backend)
        own = {"three_path": "prompts", "mla": "decode_rows", "mla_triton": "decode_rows"}.get(name)
        if own and lens is steps[1 if name == "three_path" else 2]:
            assert getattr(got, own) is not None   # the backend's own integers are part of the step
        want = backend.build_metadata(plan, inputs.block_table.clone(), inputs.slot_mapping.clone())
        got_tensors, want_tensors = dict(_tensors(got)), dict(_tensors(want))
        assert got_tensors.keys() == want_tensors.keys()
        for path, tensor in got_tensors.items():
            assert torch.equal(tensor, want_tensors[path]), path
        storage = inputs.block_table.untyped_storage().data_ptr()
        shared = [path for path, t in got_tensors.items() if t.dtype == torch.int32 and "block_table" not in path
                  and path != "meta.context_cu_seqlens_q"]   # two_path's: one subtraction on the device
        assert shared and all(got_tensors[p].untyped_storage().data_ptr() == storage for p in shared), shared
