"""Paged KV-cache blocks: allocation, reference counts, and prefix caching with LRU eviction.

The cache of every layer is ``num_blocks`` blocks of ``block_size`` token slots; one block id addresses the
same slots in every layer. Block 0 is reserved (never handed out), so a zero in a padded block table reads
harmless data. Usable blocks are ``1 .. num_blocks - 1``.

Prefix caching: a *full* block of a request is identified by the chained hash
``h_i = hash((h_{i-1}, tokens of block i))`` (``h_{-1} = None``), so equal hashes mean equal whole prefixes.
Full computed blocks are registered under their hash; a new request whose leading blocks hash the same
reuses them (reference count + 1) and only computes the rest, which makes its first step an *extend*. A
block whose count drops to 0 stays cached and *evictable*: it is reused on a hit, or evicted (its hash
forgotten) when a fresh block is needed and no never-cached free block is left, least recently freed first.

``recompute_last_hit_block`` (speculative decoding's ``mtp`` method): a hit gives all matched blocks but the
last, which the request computes again. The MTP layer's cache row of a block's last position depends on the
token after the block, which the block's hash does not cover; the blocks before the last matched one were
followed by that same token, the last one by a token of some other request (vLLM does the same for EAGLE).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from tripath.engine.requests.request import Request


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: depends on the block's tokens and on every block before it."""
    return hash((parent_hash, tuple(token_ids)))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out block ids, counts their users and remembers which full blocks hold which prefix."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 recompute_last_hit_block: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.recompute_last_hit_block = recompute_last_hit_block
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}                  # hash -> block id
        self._free: deque[int] = deque(range(1, num_blocks))  # ref 0, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; oldest first
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0

    # ---- counts -------------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a fresh allocation can take: never-cached free blocks plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    # ---- low-level allocation -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (reference count 1), evicting least recently freed cached blocks if needed."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {n} KV blocks: only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def share(self, block_ids: Sequence[int]) -> None:
        """One more user of each (cached) block; an evictable block stops being evictable."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                self._evictable.pop(block)
            self.ref_counts[block] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """One user fewer of each block. Freed in reverse, so a sequence's tail is evicted before its head
        (a shorter prefix is more likely to be shared)."""
        for block in reversed(block_ids):
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.block_hash[block] = None
        self.block_tokens[block] = None

    # ---- prefix cache -------------------------------------------------------------------------------
    def register(self, block: int, block_hash: int, token_ids: Sequence[int]) -> None:
        """Remember that the full ``block`` holds the prefix hashed ``block_hash`` (first copy wins)."""
        if not self.enable_prefix_caching:
            return
        self.block_hash[block] = block_hash
        self.block_tokens[block] = tuple(token_ids)
        self.cached.setdefault(block_hash, block)

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[int]]:
        """The cached blocks holding the longest full-block prefix of ``token_ids[:max_tokens]``.

        Returns ``(block_ids, hashes)``; no reference is taken (see :meth:`share`).
        """
        blocks, hashes = [], []
        if not self.enable_prefix_caching:
            return blocks, hashes
        parent = None
        bs = self.block_size
        for i in range(max_tokens // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, tokens)
            block = self.cached.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    # ---- per-request helpers used by the scheduler ----------------------------------------------------
    def admit(self, request: Request, num_new_tokens_max: int, whole: bool = False) -> int | None:
        """Give a waiting request its cached prefix and blocks for up to ``num_new_tokens_max`` new tokens
        (with ``whole``, for all its uncached tokens or nothing).

        At least one token is always left to compute (its logits give the next token). Returns the number of
        new tokens it may compute now (> 0), or None, changing nothing, when the budget or the free blocks
        do not suffice.
        """
        assert not request.block_ids and request.num_computed_tokens == 0
        total = request.num_tokens
        # a request scoring its prompt computes every position not scored yet
        reusable = total - 1 if request.prompt_logprobs is None else min(total - 1, request.num_prompt_logprobs_done)
        hit_blocks, hit_hashes = self.match_prefix(request.all_token_ids, reusable)
        if self.recompute_last_hit_block and hit_blocks:
            hit_blocks, hit_hashes = hit_blocks[:-1], hit_hashes[:-1]
        num_cached = len(hit_blocks) * self.block_size
        num_new = min(total - num_cached, num_new_tokens_max)
        if num_new <= 0 or (whole and num_new < total - num_cached):
            return None
        fresh = blocks_needed(num_cached + num_new, self.block_size) - len(hit_blocks)
        reactivated = sum(1 for b in hit_blocks if self.ref_counts[b] == 0)
        if fresh + reactivated > self.num_free_blocks:
            return None
        self.share(hit_blocks)
        request.block_ids = hit_blocks + self.allocate(fresh)
        request.block_hashes = hit_hashes
        request.num_computed_tokens = num_cached
        if self.enable_prefix_caching:
            self.num_hit_tokens += num_cached
            self.num_queried_tokens += total
        return num_new

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Make the request's blocks cover ``num_computed_tokens + num_new_tokens`` tokens; False (nothing
        changed) when there are not enough free blocks."""
        need = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size) - len(request.block_ids)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        request.block_ids.extend(self.allocate(need))
        return True

    def max_growth(self, request: Request) -> int:
        """How many new tokens the request could compute with its blocks plus every free block."""
        slots = (len(request.block_ids) + self.num_free_blocks) * self.block_size
        return max(0, slots - request.num_computed_tokens)

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks (after the step computing their tokens was
        launched); an in-flight token's block waits until the token is known."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, num_full = len(request.block_hashes), min(request.num_computed_tokens, request.num_tokens) // bs
        if first >= num_full:
            return
        new_tokens = request.token_ids(first * bs, num_full * bs)  # one slice for every new block
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else None
        for i in range(first, num_full):
            at = (i - first) * bs
            tokens = tuple(new_tokens[at:at + bs])
            parent = hash_block(parent, tokens)
            self.register(request.block_ids[i], parent, tokens)
            hashes.append(parent)

    def release(self, request: Request) -> None:
        """Drop the request's blocks (finished or preempted); its full blocks stay cached."""
        self.free(request.block_ids)
        request.block_ids = []
        request.block_hashes = []
        request.num_computed_tokens = 0
