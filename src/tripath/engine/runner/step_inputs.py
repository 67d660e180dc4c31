"""A step's device inputs, built on the host with little Python per request and sent in two copies, the
attention metadata's integers among them.

For a step whose requests are in plan order (``plan.order``), with request ``r`` contributing tokens
``[start_r, start_r + n_r)``:

- ``input_ids [T]`` / ``positions [T]`` int64: the new tokens and their positions, request by request;
- ``slot_mapping [T]`` int64: ``block_ids[p // block_size] * block_size + p % block_size`` of position ``p``
  (−1 for padding rows, which write nothing);
- ``block_table [B, width]`` int32: each request's block ids (unused entries 0: block 0 is reserved),
  ``width`` the longest row of the step;
- ``logit_indices [S + R]`` int64: the last token of each request whose step reaches the end of its tokens
  (``S`` of them), then every token of each verify (speculative decoding: ``R`` rows in all);
- ``tree_mask`` int32 (a step with draft trees): for each token of the decode slice's multi-token rows (the
  verifies, and prompt chunks as short), its ancestors among its request's new tokens
  (:func:`~tripath.engine.speculative.trees.tree_mask_bits`; chains and chunks causal), row after row;
  a tree's tokens sit at positions ``context_len + depth``, their slots those of ``context_len + row``;
- ``deferred``: for decodes whose input token a launched step is still sampling (overlapped scheduling),
  ``(rows [K], sources [K])`` int64: ``input_ids[rows[k]]`` is to be taken from row ``sources[k]`` of that
  step's sampled tokens on the device; None when every input token is known;
- ``ints``: the backend's metadata integers of the step (:mod:`tripath.attention.step_ints`), placed on the
  device, from which :meth:`StepInputs.metadata` builds the step's attention metadata.

The int64 arrays are written into one pinned host buffer, the int32 ones (block table, metadata integers, tree
masks) into another, each sent to the device with one asynchronous copy; an event guards the buffers, so a
step never overwrites host memory a previous step's copy still reads. Each scheduled request's block list is
kept in a row of one NumPy array across steps (:class:`_BlockStore`): a step copies in only the ids its lists
gained, and the step's block table is one gather of those rows in plan order. Positions and slots come for
every row at once from the plan's query and context lengths, a prompt chunk's ids are a slice of the
request's prompt array (:meth:`~tripath.engine.requests.request.Request.token_array`): the Python left per row
is one pass over the step's rows (a decode's one token, or where its in-flight token comes from, and the rows
whose logits are drawn) and one over its block lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tripath.attention.step_ints import StepInts
from tripath.engine.speculative.trees import chain_parents, depths, tree_mask_bits


@dataclass
class StepInputs:
    """One step's device inputs and where each sampled token goes (``sample_rows[k]``: index into the
    scheduled list of the request whose logits are row ``k``; the verifies' rows follow, ``num_new_tokens``
    each, in ``verify_rows`` order)."""

    plan: object
    input_ids: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    logit_indices: torch.Tensor
    sample_rows: list[int]
    num_padding: int = 0
    deferred: tuple[torch.Tensor, torch.Tensor] | None = None
    verify_rows: list[int] | None = None   # indices into the scheduled list of the verifies, in logit order
    verify_starts: list[int] | None = None   # each verify's first token row (its pending token), in that order
    tree_mask: torch.Tensor | None = None    # int32: the decode slice's multi-token rows' masks (draft trees)
    ints: StepInts | None = None             # the metadata's integers, on the device (None: not staged)

    def metadata(self, backend):
        """The step's attention metadata (``backend.build_metadata`` of these inputs: its integers are on the
        device already, the draft trees' masks set)."""
        meta = backend.build_metadata(self.plan, self.block_table, self.slot_mapping, ints=self.ints)
        if self.tree_mask is not None:
            meta.decode.verify.tree_mask = self.tree_mask
        return meta


class _BlockStore:
    """Each scheduled request's block ids, kept across steps as a row of one int32 array ``rows [capacity,
    max_blocks]`` (zero past the request's count; row 0 stays zero, for padding rows). A row is tied to the
    request's block-list object and extended in place as that list grows (the block manager replaces the list
    when it frees the blocks); rows of lists no step scheduled last time are freed."""

    def __init__(self, max_requests: int, max_blocks: int):
        self.rows = np.zeros((max_requests + 1, max(1, max_blocks)), dtype=np.int32)
        self._free = list(range(max_requests, 0, -1))
        self._lists: dict[int, list] = {}   # id of a block list -> [the list, its row, ids copied, step seen]
        self._step = 0

    def sync(self, scheduled) -> tuple[list[int], list[int]]:
        """``(rows, counts)``: each scheduled request's row and block count, its new block ids copied in. One
        pass over ``scheduled``; the lists it does not hold are looked for only when there are some."""
        self._step = step = self._step + 1
        lists = self._lists
        rows, counts, fresh = [], [], []
        seen = 0
        for k, item in enumerate(scheduled):
            source = item.request.block_ids
            entry = lists.get(id(source))
            if entry is not None and entry[3] == step:   # a list two rows share
                if entry[1] < 0:
                    fresh.append((k, entry))
                rows.append(entry[1])
                counts.append(entry[2])
                continue
            seen += 1
            if entry is None or entry[0] is not source:   # a new list (or a dead one's id reused)
                if entry is not None:
                    self._release(entry)
                lists[id(source)] = entry = [source, -1, 0, step]
                fresh.append((k, entry))
                rows.append(-1)
                counts.append(0)
                continue
            entry[3] = step
            n = len(source)
            if n != entry[2]:
                self._copy(entry, n)
            rows.append(entry[1])
            counts.append(n)
        if len(lists) > seen:   # lists this step does not schedule: their rows back
            for key in [key for key, entry in lists.items() if entry[3] != step]:
                self._release(lists.pop(key))
        for k, entry in fresh:
            if entry[1] < 0:
                if not self._free:
                    self._grow(self.rows.shape[0], self.rows.shape[1])
                entry[1] = self._free.pop()
                self._copy(entry, len(entry[0]))
            rows[k] = entry[1]
            counts[k] = entry[2]
        return rows, counts

    def _copy(self, entry: list, n: int) -> None:
        """Bring ``entry``'s row to its list's first ``n`` ids."""
        source, row, count = entry[0], entry[1], entry[2]
        if n > self.rows.shape[1]:
            self._grow(0, n)
        if n > count:
            self.rows[row, count:n] = source[count:n]
        else:   # shorter: copied again (the engine's lists only grow in place)
            self.rows[row, :count] = 0
            self.rows[row, :n] = source
        entry[2] = n

    def _release(self, entry: list) -> None:
        if entry[1] >= 0:
            self.rows[entry[1], :entry[2]] = 0
            self._free.append(entry[1])

    def _grow(self, more_rows: int, min_blocks: int) -> None:
        old = self.rows
        grown = np.zeros((old.shape[0] + more_rows, max(old.shape[1], min_blocks)), dtype=np.int32)
        grown[:old.shape[0], :old.shape[1]] = old
        self._free.extend(range(grown.shape[0] - 1, old.shape[0] - 1, -1))
        self.rows = grown


class StepInputBuilder:
    """Builds :class:`StepInputs` for one engine (``block_size``, limits sizing the staging buffers)."""

    def __init__(self, device: torch.device, block_size: int, max_tokens: int, max_requests: int,
                 max_blocks_per_seq: int):
        self.device = device
        self.block_size = block_size
        self._blocks = _BlockStore(max_requests, max_blocks_per_seq)
        pin = device.type == "cuda"
        max_tokens = max(max_tokens, max_requests)  # a padded decode step has a token per row
        self._int64 = torch.zeros(3 * max_tokens + 3 * max_requests, dtype=torch.int64, pin_memory=pin)
        self._pin = pin
        self._int32 = torch.zeros(max_requests * (max_blocks_per_seq + 8), dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None

    def build(self, plan, scheduled, num_padding: int, inflight_rows: dict[int, int] | None = None,
              ints: StepInts | None = None) -> StepInputs:
        """Inputs for ``scheduled`` (the caller's order) laid out in ``plan``'s order; rows past
        ``len(scheduled)`` are ``num_padding`` decode rows at position 1 reading block 0, writing nothing.
        ``inflight_rows``: ``id(request) -> row`` of the launched step's sampled tokens, for requests whose
        input token is still in flight. ``ints``: the backend's ``step_ints(plan)``, sent with the block table
        and placed."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the staging buffers
        bs = self.block_size
        num_tokens, num_rows, order = plan.num_tokens, plan.num_requests, plan.order
        num_scheduled = len(scheduled)
        store_rows, block_counts = self._blocks.sync(scheduled)
        order_array = np.asarray(order, dtype=np.int64)
        lens = np.asarray(block_counts + [0] * num_padding, dtype=np.int64)[order_array]
        width = max(1, int(lens.max(initial=0)))
        flat = self._int64.numpy()
        ids, positions, slots = flat[:num_tokens], flat[num_tokens:2 * num_tokens], flat[2 * num_tokens:3 * num_tokens]
        n_table = num_rows * width
        num_ints = 0 if ints is None else len(ints.values)
        self._reserve_int32(n_table + num_ints + num_tokens)   # tree masks: at most a bit word per token
        int32 = self._int32.numpy()
        table = int32[:n_table].reshape(num_rows, width)
        store = self._blocks.rows
        np.take(store[:, :width], np.asarray(store_rows + [0] * num_padding, dtype=np.int64)[order_array], axis=0,
                out=table)
        # positions and slots, every row at once: row r's tokens sit at start_r .. start_r + n_r - 1 (the plan's
        # query and context lengths; a padding row: one token at position 1)
        counts = np.asarray(plan.query_lens, dtype=np.int64)
        starts = np.asarray(plan.context_lens, dtype=np.int64)
        first = np.cumsum(counts) - counts            # each row's first token
        token_row = np.repeat(np.arange(num_rows), counts)
        positions[:] = np.arange(num_tokens) - np.repeat(first - starts, counts)
        slots[:] = table[token_row, positions // bs].astype(np.int64) * bs + positions % bs
        firsts = first.tolist()
        if num_padding:   # padding: token 0 at position 1, writing nothing
            pads = [firsts[row] for row, i in enumerate(order) if i >= num_scheduled]
            ids[pads] = 0
            slots[pads] = -1
        # one pass over the rows in plan order: a decode's token (known, or where its in-flight token comes
        # from) and the rows whose logits are drawn; rows of several tokens are handled after it
        known_rows, known_ids, deferred_rows, deferred_sources = [], [], [], []
        logit_rows, sample_rows, multi = [], [], []
        inflight = inflight_rows if inflight_rows is not None else {}
        for row, i in enumerate(order):
            if i >= num_scheduled:
                continue
            item = scheduled[i]
            at = firsts[row]
            n = item.num_new_tokens
            if n == 1:
                request, start = item.request, item.num_computed_tokens
                if start < request.num_tokens:
                    known_rows.append(at)
                    known_ids.append(request.token_ids(start, start + 1)[0])
                else:
                    source = inflight.get(id(request))
                    if source is None:
                        raise RuntimeError(f"{request!r} is scheduled to decode a token no launched step is sampling")
                    deferred_rows.append(at)
                    deferred_sources.append(source)
                if item.samples:
                    logit_rows.append(at)
                    sample_rows.append(i)
            else:
                multi.append((row, at, item))
                if item.samples and not item.draft_token_ids:
                    logit_rows.append(at + n - 1)
                    sample_rows.append(i)
        ids[known_rows] = known_ids
        if deferred_rows:
            ids[deferred_rows] = 0   # the token a launched step is sampling: filled in on the device
        verify_logits, verify_rows, verify_starts, tree_bits = [], [], [], []
        trees = any(item.draft_parents is not None for _, _, item in multi)
        for row, at, item in multi:
            n = item.num_new_tokens
            start, drafts = item.num_computed_tokens, item.draft_token_ids
            own = n - len(drafts)
            ids[at:at + own] = item.request.token_array(start, start + own)
            if drafts:
                ids[at + own:at + n] = drafts
                verify_logits.extend(range(at, at + n))
                verify_rows.append(order[row])
                verify_starts.append(at)
            if item.draft_parents is not None:   # a tree's tokens: at context_len + depth
                positions[at + 1:at + n] = start + np.asarray(depths(item.draft_parents), dtype=np.int64)
            if trees and row < plan.num_decodes:   # the decode slice's multi-token rows: its verifies
                parents = item.draft_parents         # (and prompt chunks as short, causal)
                tree_bits += tree_mask_bits(chain_parents(n - 1) if parents is None else parents)
        logit_rows += verify_logits
        num_logits, num_deferred = len(logit_rows), len(deferred_rows)
        end = 3 * num_tokens + num_logits
        flat[3 * num_tokens:end] = logit_rows
        flat[end:end + num_deferred] = deferred_rows
        flat[end + num_deferred:end + 2 * num_deferred] = deferred_sources
        int64 = self._to_device(self._int64[:end + 2 * num_deferred])
        if num_ints:
            int32[n_table:n_table + num_ints] = ints.values
        int32[n_table + num_ints:n_table + num_ints + len(tree_bits)] = tree_bits
        int32_dev = self._to_device(self._int32[:n_table + num_ints + len(tree_bits)])
        block_table = int32_dev[:n_table].view(num_rows, width)
        if ints is not None:
            ints.place(int32_dev[n_table:n_table + num_ints])
        if self._copied is not None:
            self._copied.record()
        deferred = (int64[end:end + num_deferred], int64[end + num_deferred:]) if num_deferred else None
        return StepInputs(plan=plan, input_ids=int64[:num_tokens], positions=int64[num_tokens:2 * num_tokens],
                          block_table=block_table, slot_mapping=int64[2 * num_tokens:3 * num_tokens],
                          logit_indices=int64[3 * num_tokens:end], sample_rows=sample_rows,
                          num_padding=num_padding, deferred=deferred, verify_rows=verify_rows or None,
                          verify_starts=verify_starts or None,
                          tree_mask=int32_dev[n_table + num_ints:] if tree_bits else None, ints=ints)

    def _reserve_int32(self, size: int) -> None:
        """Grow the int32 staging buffer to hold ``size`` values (called once the last copy has read it)."""
        if self._int32.shape[0] < size:
            self._int32 = torch.zeros(max(size, 2 * self._int32.shape[0]), dtype=torch.int32, pin_memory=self._pin)

    def _to_device(self, staged: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return staged.clone()  # the staging buffer is reused by the next step
        return staged.to(self.device, non_blocking=True)
