"""Test harness for the model tests: run a tripath model step by step through a real attention backend
(paged caches with random block tables, block 0 reserved), and Hugging Face helpers (random tiny models
with non-trivial weights, reference logits of a whole sequence)."""

from __future__ import annotations

import torch

from tripath.attention import ForwardContext, plan_batch, select_backend


class PagedRunner:
    """Feeds ``model`` whole steps: ``step({request_id: new_token_ids})`` → ``{request_id: logits [q, vocab]}``.

    Requests are given in the caller's order; the planner reorders them ``[decode | extend | prefill]`` and
    the runner maps the outputs back. Blocks come from a random permutation of ``1..num_blocks-1``.
    """

    def __init__(self, model, *, backend: str = "torch", block_size: int = 16, num_blocks: int = 48,
                 device="cpu", **spec_options):
        self.model = model
        self.spec = model.attention_spec(block_size=block_size, **spec_options)
        self.backend = select_backend(self.spec, backend, device)
        self.caches = [self.backend.allocate_cache(num_blocks, device) for _ in range(model.num_attention_layers)]
        self.free = (torch.randperm(num_blocks - 1) + 1).tolist()
        self.blocks: dict = {}
        self.lens: dict = {}
        self.device = torch.device(device)
        self.last_plan = None

    def _reserve(self, rid, total: int) -> None:
        blocks = self.blocks.setdefault(rid, [])
        while len(blocks) * self.spec.block_size < total:
            blocks.append(self.free.pop())

    def prepare(self, new_tokens: dict):
        """Plan one step: ``(input_ids [T], positions [T], ForwardContext, [(request_id, q_len)] in plan
        order)``; the requests' lengths advance as if the step ran."""
        rids = list(new_tokens)
        query_lens = [len(new_tokens[r]) for r in rids]
        context_lens = [self.lens.get(r, 0) for r in rids]
        plan = plan_batch(query_lens, context_lens, decode_threshold=self.spec.decode_threshold,
                          chunk_budget=self.spec.extend_chunk_budget, block_size=self.spec.block_size)
        self.last_plan = plan
        ids, positions, slots, rows = [], [], [], []
        bs = self.spec.block_size
        for j in plan.order:
            rid, ctx, q = rids[j], context_lens[j], query_lens[j]
            self._reserve(rid, ctx + q)
            pos = list(range(ctx, ctx + q))
            ids += list(new_tokens[rid])
            positions += pos
            slots += [self.blocks[rid][p // bs] * bs + p % bs for p in pos]
            rows.append(self.blocks[rid])
        width = max(len(r) for r in rows)
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        dev = self.device
        meta = self.backend.build_metadata(plan, table.to(dev), torch.tensor(slots, dtype=torch.int64, device=dev))
        ctx = ForwardContext(self.backend, meta, self.caches)
        for j in plan.order:
            self.lens[rids[j]] = context_lens[j] + query_lens[j]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=dev)  # noqa: E731
        return as_tensor(ids), as_tensor(positions), ctx, [(rids[j], query_lens[j]) for j in plan.order]

    def step(self, new_tokens: dict) -> dict:
        ids, positions, ctx, order = self.prepare(new_tokens)
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(ids, positions, ctx))
        out, start = {}, 0
        for rid, q in order:
            out[rid] = logits[start:start + q]
            start += q
        return out


def randomize_hf_weights(model, seed: int = 0) -> None:
    """Weights that make every feature visible in the logits: linear/embedding weights ``N(0, 1/fan_in)``
    (embeddings ``N(0, 1)``), biases and router correction biases ``N(0, 0.1²)``, norm weights ``1 + N(0, 0.1²)``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def hf_logits(hf_model, token_ids) -> torch.Tensor:
    """Logits ``[S, vocab]`` fp32 of the Hugging Face model over one whole sequence."""
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([list(token_ids)]), use_cache=False)
    return out.logits[0].float()


def assert_same_or_near_tie(model, prompts, expected, got, max_gap=0.05):
    """Greedy outputs agree, except where a run of different but valid floating-point order (CUDA-graph
    replays pad the batch and fix the decode split count; tight memory recomputes preempted requests) takes
    the other side of a near tie: at the first differing token, the reference logits (the ``torch``
    backend) of both candidates must be within ``max_gap``. A real bug diverges at a clear winner."""
    for prompt, want, have in zip(prompts, expected, got):
        if want == have:
            continue
        i = next(j for j, (a, b) in enumerate(zip(want, have)) if a != b)
        runner = PagedRunner(model, backend="torch", device="cuda", num_blocks=64)
        logits = runner.step({0: list(prompt) + want[:i]})[0][-1].float()
        gap = abs(float(logits[want[i]] - logits[have[i]]))
        assert gap <= max_gap, (f"outputs diverge at token {i} ({want[i]} vs {have[i]}) where the reference "
                                f"logits differ by {gap:.4f} (> {max_gap}): not a near tie")


class ReplayRecorder:
    """Stands in for a CUDA graph on the CPU: replay re-runs the captured closure (same static inputs, same
    captured metadata object) and writes into the captured output, as a graph replay would."""

    replays = 0

    def __init__(self, run, hidden):
        self.run, self.hidden = run, hidden

    def replay(self):
        ReplayRecorder.replays += 1
        self.hidden.copy_(self.run())


def record_graph_captures(monkeypatch) -> None:
    """Make the decode graphs' captures :class:`ReplayRecorder` stand-ins (CPU graph path)."""
    def capture(run, pool, device):
        hidden = run()
        return ReplayRecorder(run, hidden), hidden, None

    monkeypatch.setattr("tripath.engine.runner.decode_graphs.capture_graph", capture)
