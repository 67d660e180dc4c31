"""Scheduler: budgets, [decode | extend | prefill] priorities, chunked prefill, prefix hits, preemption.

A fake paged "model" checks the bookkeeping end to end without attention math: each step writes every new
token id into a slot store at ``block_ids[pos // bs] * bs + pos % bs`` and reads the whole sequence back
through the block table; the next token is a hash of what it read. Wrong block tables, stale prefix hits or
a lost output after preemption all change the generated tokens.
"""

import random

import pytest

from tripath.engine.requests.request import FinishReason, Request, RequestStatus
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.scheduling.block_manager import BlockManager
from tripath.engine.scheduling.scheduler import Scheduler

VOCAB = 50


class FakePagedModel:
    def __init__(self, block_size):
        self.bs = block_size
        self.slots = {}

    def step(self, out):
        """Each scheduled request's sampled tokens, one per model step of ``out`` (step ``j`` writes the
        positions ``j`` past the first step's), none for a request mid-prompt."""
        sampled = []
        for item in out.scheduled:
            r = item.request
            known, got = r.all_token_ids, []
            for j in range(out.num_steps):
                start = item.num_computed_tokens + j
                for pos in range(start, start + item.num_new_tokens):
                    self.slots[r.block_ids[pos // self.bs] * self.bs + pos % self.bs] = (known + got)[pos]
                if not item.samples:
                    break
                seen = [self.slots[r.block_ids[p // self.bs] * self.bs + p % self.bs]
                        for p in range(len(known) + len(got))]
                assert seen == known + got, "the cache does not hold the request's tokens"
                got.append(hash(tuple(seen)) % VOCAB)
            sampled.append(got)
        return sampled


def make_scheduler(num_blocks=64, bs=4, seqs=8, budget=32, max_len=256, prefix=True, chunked=True):
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=prefix)
    return Scheduler(bm, max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                     enable_chunked_prefill=chunked)


def make_request(tokens, max_tokens=6, **kw):
    return Request(list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), **kw)


def run(sched, requests, check=None, max_steps=2000, decode_steps=1):
    """Drive the scheduler to completion; returns {request_id: outputs} and the list of step outputs."""
    if not hasattr(sched, "fake_model"):  # the slot store lives as long as the cache
        sched.fake_model = FakePagedModel(sched.block_manager.block_size)
    model = sched.fake_model
    for r in requests:
        sched.add(r)
    steps = []
    while sched.has_unfinished:
        out = sched.schedule(decode_steps)
        assert not out.is_empty, "the scheduler stalled"
        if check:
            check(sched, out)
        steps.append([(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled])
        sched.update(out, model.step(out))
        assert len(steps) < max_steps
    return {r.request_id: list(r.output_token_ids) for r in requests}, steps


def random_prompts(n, seed, lo=3, hi=40, shared=0):
    rng = random.Random(seed)
    common = [rng.randrange(VOCAB) for _ in range(shared)]
    return [common + [rng.randrange(VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_budget_and_sequence_limit_hold_every_step():
    def check(sched, out):
        assert 0 < out.num_tokens <= 16
        assert len(sched.running) <= 3

    prompts = random_prompts(7, seed=1)
    outs, _ = run(make_scheduler(seqs=3, budget=16), [make_request(p) for p in prompts], check)
    assert all(len(o) == 6 for o in outs.values())


def test_decodes_first_then_extends_then_prefills():
    sched = make_scheduler(budget=12)
    model = FakePagedModel(4)
    a, b = make_request(range(1, 4)), make_request(range(10, 26))  # a: 3 tokens; b: 16 (chunked)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(a, 0, 3), (b, 0, 9)]
    sched.update(out, model.step(out))
    c = make_request(range(40, 45))
    sched.add(c)
    out = sched.schedule()
    # a decodes, b continues its prompt (an extend), c's prefill gets what is left of the budget.
    assert [(s.request, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [
        (a, 3, 1), (b, 9, 7), (c, 0, 4)]
    assert [s.samples for s in out.scheduled] == [True, True, False]


def test_decode_gets_the_budget_before_an_older_prompt_chunk():
    sched = make_scheduler(budget=8)
    model = FakePagedModel(4)
    long_, short = make_request(range(1, 30)), make_request(range(50, 52))
    sched.add(short)
    sched.add(long_)
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(short, 2), (long_, 6)]
    sched.update(out, model.step(out))
    # An older request part-way through its prompt (e.g. one whose chunk shrank for lack of blocks) must
    # not starve a decode: put it first in the running order.
    sched.running.reverse()
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(short, 1), (long_, 7)]


def test_chunked_prefill_spreads_a_long_prompt_and_gives_the_same_tokens():
    prompts = random_prompts(4, seed=2, lo=30, hi=60)
    chunked, steps = run(make_scheduler(budget=16), [make_request(p, request_id=str(i))
                                                     for i, p in enumerate(prompts)])
    whole, _ = run(make_scheduler(budget=64, chunked=False), [make_request(p, request_id=str(i))
                                                             for i, p in enumerate(prompts)])
    assert chunked == whole
    assert any(ctx > 0 and n > 1 for step in steps for _, ctx, n in step), "no extend chunk was produced"


def test_without_chunked_prefill_prompts_wait_whole_and_overlong_ones_are_refused():
    sched = make_scheduler(budget=16, chunked=False)
    a, b = make_request(range(1, 11)), make_request(range(20, 30))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 10)]
    with pytest.raises(ValueError, match=r"exceeds max_num_batched_tokens \(16\) and chunked prefill is off"):
        sched.add(make_request(range(1, 14), max_tokens=5))


def test_prefix_hit_produces_an_extend_with_identical_tokens():
    prompts = random_prompts(6, seed=3, shared=13)
    sched = make_scheduler()
    first = make_request(prompts[0], request_id="0")
    outs_hit, _ = run(sched, [first])
    rest = [make_request(p, request_id=str(i)) for i, p in enumerate(prompts[1:], 1)]
    more, steps = run(sched, rest)
    outs_hit.update(more)
    assert steps[0][0][1] == 12  # 3 full blocks of 4 shared tokens were cached
    assert sched.block_manager.num_hit_tokens >= 12 * 5
    no_cache, _ = run(make_scheduler(prefix=False), [make_request(p, request_id=str(i))
                                                     for i, p in enumerate(prompts)])
    assert outs_hit == no_cache


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preemption_by_recompute_gives_identical_results(seed):
    prompts = random_prompts(10, seed=seed, lo=5, hi=30)
    params = dict(max_tokens=12)
    ample, _ = run(make_scheduler(num_blocks=200, seqs=10, budget=48),
                   [make_request(p, request_id=str(i), **params) for i, p in enumerate(prompts)])
    tight_sched = make_scheduler(num_blocks=14, seqs=10, budget=48)  # 13 blocks of 4 = 52 slots
    reqs = [make_request(p, request_id=str(i), **params) for i, p in enumerate(prompts)]
    tight, _ = run(tight_sched, reqs)
    assert tight_sched.num_preemptions > 0
    assert tight == ample
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert sum(r.num_preemptions for r in reqs) == tight_sched.num_preemptions
    assert tight_sched.block_manager.num_free_blocks == 13


def test_the_youngest_running_request_is_preempted_and_resumes_first():
    sched = make_scheduler(num_blocks=5, bs=4, budget=64, prefix=False)  # 4 usable blocks
    model = FakePagedModel(4)
    old, young = make_request(range(1, 8), max_tokens=8), make_request(range(20, 27), max_tokens=8)
    sched.add(old)
    sched.add(young)
    out = sched.schedule()  # 7 + 7 tokens: 2 blocks each
    sched.update(out, model.step(out))
    out = sched.schedule()  # both decode at position 7: still fits
    sched.update(out, model.step(out))
    out = sched.schedule()  # position 8 needs a third block each: young is preempted for old
    assert out.preempted == [young] and [s.request for s in out.scheduled] == [old]
    assert young.status is RequestStatus.WAITING and sched.waiting[0] is young
    assert young.block_ids == [] and young.num_computed_tokens == 0 and young.num_output_tokens == 2
    sched.update(out, model.step(out))


def test_add_refuses_requests_that_could_never_fit():
    sched = make_scheduler(num_blocks=5, bs=4, max_len=64)
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(64\)"):
        sched.add(make_request(range(60), max_tokens=5))
    with pytest.raises(ValueError, match=r"needs more KV blocks than the cache holds \(4 blocks of 4\)"):
        sched.add(make_request(range(14), max_tokens=3))
    sched.add(make_request(range(13), max_tokens=3))


def test_abort_releases_blocks_anywhere():
    sched = make_scheduler(num_blocks=20)
    model = FakePagedModel(4)
    a, b = make_request(range(1, 9), request_id="a"), make_request(range(1, 9), request_id="b")
    sched.add(a)
    out = sched.schedule()
    sched.update(out, model.step(out))
    sched.add(b)
    assert sched.abort("b") is b and b.finish_reason is FinishReason.ABORTED
    assert sched.abort("a") is a and a.is_finished and not sched.has_unfinished
    assert sched.abort("zzz") is None
    assert sched.block_manager.num_free_blocks == 19


def test_stop_tokens_and_eos_finish_early():
    model = FakePagedModel(4)
    sched = make_scheduler()
    r = Request([1, 2, 3], SamplingParams(max_tokens=50, temperature=0), eos_token_ids=(7,))
    sched.add(r)
    out = sched.schedule()
    token = model.step(out)[0][0]
    r.sampling_params = SamplingParams(max_tokens=50, temperature=0, stop_token_ids=[token])
    sched.update(out, [[token]])
    assert r.finish_reason is FinishReason.STOP and r.output_token_ids == [token]
    r2 = Request([1], SamplingParams(max_tokens=50, temperature=0), eos_token_ids=(5,))
    r2.append_token(5)
    assert r2.finish_reason is FinishReason.STOP
    r3 = Request([1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), eos_token_ids=(5,))
    r3.append_token(5)
    assert not r3.is_finished
    r3.append_token(5)
    assert r3.finish_reason is FinishReason.LENGTH


# ---- multi-step decoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_multi_step_decoding_gives_the_same_tokens(seed):
    rng = random.Random(seed)
    prompts = random_prompts(9, seed=seed, lo=3, hi=30, shared=8)
    max_tokens = [rng.randrange(1, 20) for _ in prompts]

    def requests():
        return [make_request(p, max_tokens=m, request_id=str(i)) for i, (p, m) in enumerate(zip(prompts, max_tokens))]

    steps_seen = []

    def check(sched, out):
        steps_seen.append(out.num_steps)
        if out.num_steps > 1:  # decodes alone, nothing admissible, blocks for every step
            assert all(s.num_new_tokens == 1 and s.samples for s in out.scheduled)
            assert not sched.waiting or len(sched.running) >= sched.max_num_seqs
            for s in out.scheduled:
                r = s.request
                assert out.num_steps <= r.sampling_params.max_tokens - r.num_output_tokens
                assert len(r.block_ids) * 4 >= s.num_computed_tokens + out.num_steps

    one, _ = run(make_scheduler(num_blocks=200, seqs=4, budget=24), requests())
    for num_blocks in (200, 20):  # 20: tight, with preemptions and steps that fall back to one
        sched = make_scheduler(num_blocks=num_blocks, seqs=4, budget=24)
        many, _ = run(sched, requests(), check, decode_steps=5)
        assert many == one
        assert sched.block_manager.num_free_blocks == num_blocks - 1
    assert max(steps_seen) == 5 and 1 < min(n for n in steps_seen if n > 1) < 5  # capped by max_tokens too


def test_multi_step_waits_while_a_request_could_be_admitted():
    sched = make_scheduler(seqs=2)
    model = FakePagedModel(4)
    a, b, c = (make_request(range(i, i + 5), max_tokens=20) for i in (1, 10, 20))
    sched.add(a)
    out = sched.schedule(8)
    sched.update(out, model.step(out))
    out = sched.schedule(8)  # a decodes alone, nothing waits
    assert out.num_steps == 8 and [s.request for s in out.scheduled] == [a]
    assert a.num_computed_tokens == 5 + 8 and a.num_inflight_tokens == 8
    sched.update(out, model.step(out))
    assert a.num_output_tokens == 9 and a.num_inflight_tokens == 0
    sched.add(b)
    out = sched.schedule(8)  # b can be admitted: one step, with b's prefill
    assert out.num_steps == 1 and [s.request for s in out.scheduled] == [a, b]
    sched.update(out, model.step(out))
    sched.add(c)  # c waits, but max_num_seqs (2) run: a and b decode 8 steps
    out = sched.schedule(8)
    assert out.num_steps == 8 and [s.request for s in out.scheduled] == [a, b]


def test_multi_step_drops_the_tokens_after_a_stop_token():
    sched = make_scheduler()
    model = FakePagedModel(4)
    r = Request([1, 2, 3], SamplingParams(max_tokens=50, temperature=0, stop_token_ids=[9]))
    sched.add(r)
    out = sched.schedule(4)
    sched.update(out, model.step(out))
    first = r.output_token_ids[0]
    out = sched.schedule(4)
    assert out.num_steps == 4 and len(r.block_ids) == 2  # 3 + 1 + 4 tokens: blocks for all of them
    finished = sched.update(out, [[5, 9, 6, 7]])
    assert finished == [r] and r.finish_reason is FinishReason.STOP
    assert r.output_token_ids == [first, 5, 9]
    assert not sched.has_unfinished and sched.block_manager.num_free_blocks == 63


def test_multi_step_falls_back_to_one_step_without_blocks_for_every_step():
    sched = make_scheduler(num_blocks=4, bs=4, prefix=False)  # 3 usable blocks
    model = FakePagedModel(4)
    a, b = make_request(range(1, 5), max_tokens=8), make_request(range(10, 14), max_tokens=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule(4)  # 4 + 4 tokens: 2 blocks; a third is free
    sched.update(out, model.step(out))
    out = sched.schedule(4)  # 4 steps each need a block each: 2 > 1 free
    assert out.num_steps == 1
    assert sched.block_manager.num_free_blocks == 1


def test_pacing_sets_the_budget_within_the_cap_and_above_the_running_decodes():
    """``pace`` (step pacing) never goes past ``max_num_batched_tokens`` or the budget an out-of-memory step
    left, nor below the running requests or 16; a long prompt paced to 16 tokens a step gives the tokens of
    an unpaced run; without chunked prefill the budget stays."""
    from tripath.engine.scheduling.scheduler import MIN_PACED_BUDGET

    sched = make_scheduler(budget=256, seqs=32, num_blocks=256)
    assert sched.pace(64) == 64 and sched.pace(10 ** 6) == 256 and sched.pace(1) == MIN_PACED_BUDGET
    sched.running.extend(object() for _ in range(20))   # 20 running requests: each decode stays in the step
    assert sched.pace(1) == 20
    sched.running.clear()
    sched.pace(256)
    assert sched.shrink_token_budget() == 128 and sched.pace(10 ** 6) == 128   # the out-of-memory cap holds
    prompts = random_prompts(3, seed=5, lo=60, hi=90)
    want, _ = run(make_scheduler(budget=256, num_blocks=256), [make_request(p) for p in prompts])
    paced = make_scheduler(budget=256, num_blocks=256)
    paced.pace(16)
    got, steps = run(paced, [make_request(p) for p in prompts],
                     check=lambda s, out: sum(x.num_new_tokens for x in out.scheduled) <= 16)
    assert list(got.values()) == list(want.values()) and len(steps) > sum(map(len, prompts)) // 16
    whole = make_scheduler(budget=256, chunked=False)
    assert whole.pace(16) == 256


def test_the_step_pacer_follows_the_steps_its_budget_bounds():
    """The budget starts at 256 tokens; a bounded step under half the target doubles it (up to the cap), one
    over the target shrinks it in proportion (in multiples of 64); a step the budget did not bound (fewer
    tokens than half of it), however slow, changes nothing."""
    from tripath.engine.scheduling.step_pacing import StepPacer

    sched = make_scheduler(budget=4096, num_blocks=256)
    pacer = StepPacer(sched, target_s=0.5)
    assert sched.token_budget == 256
    pacer.observe(8, 30.0)                 # a few decodes during a pause of the machine: nothing
    assert sched.token_budget == 256
    for budget in (512, 1024, 2048, 4096, 4096):   # fast steps that fill the budget: doubled to the cap
        pacer.observe(sched.token_budget, 0.1)
        assert sched.token_budget == budget
    pacer.observe(4096, 2.0)               # 4x the target: a quarter of the tokens
    assert sched.token_budget == 1024
    pacer.observe(1000, 0.6)               # 1.2x: 853 -> 832, a multiple of 64
    assert sched.token_budget == 832
    pacer.observe(600, 0.4)                # within [target / 2, target]: held
    assert sched.token_budget == 832
    pacer.observe(800, 100.0)              # far over: the grain at least
    assert sched.token_budget == 64
    assert StepPacer(make_scheduler(budget=128, num_blocks=256), 0.5).budget == 128   # the cap from the start
