"""BlockManager: the paged-KV block pool with reference counts and a prefix cache.

A block id addresses one page of block_size token positions in every KV tensor (target and,
when speculating, draft). Full blocks whose KV is computed are registered under (the chained
hash of the blocks before, token ids), so requests sharing a prefix share blocks. The chained
hash is sha256 (Python's hash() of ints is predictable, and a crafted collision would hand one
prompt another's KV), and its root is the request's cache_salt: requests with different salts
share no block, so one user cannot learn from cache hits what another's prompts were (vLLM's
cache_salt). Blocks whose reference count drops to zero keep their cached content and are
evicted least recently used first, only when the free list is empty.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from tandem.scheduler.request import Request


def chain_root(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block: empty, or its cache salt's digest."""
    if cache_salt is None:
        return b""
    return hashlib.sha256(b"tandem cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def chain_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """The chained hash of a full block whose parent hash is `parent`."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """Free list + ref counts + hash-chained prefix cache with LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[tuple | None] = [None] * num_blocks  # cache key of a cached block
        self.free_ids: deque[int] = deque(range(num_blocks))  # unreferenced, no cached content
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached; LRU first
        self.cached: dict[tuple, int] = {}  # (parent's chained hash, token ids) -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(req.block_ids))

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow req's block table to cover num_tokens positions; False (and no change) if short."""
        need = -(-num_tokens // self.block_size) - len(req.block_ids)  # blocks_needed, inlined (every step)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            req.block_ids.append(self._take())
        return True

    def prefix_blocks(self, req: Request) -> list[tuple[int, int]]:
        """(block id, chained hash) of the cached blocks holding a prefix of req's tokens, which
        match_prefix attaches (nothing changes here). At least one token is always left out, so
        the step that follows has logits."""
        if not self.enable_prefix_caching or req.block_ids:
            return []
        bs = self.block_size
        tokens = req.all_token_ids
        parent, found = chain_root(req.cache_salt), []
        for i in range((len(tokens) - 1) // bs):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            block = self.cached.get(key)
            if block is None:
                break
            parent = chain_hash(*key)
            found.append((block, parent))
        return found

    def keys_filled(self, req: Request, start: int, end: int) -> list[tuple]:
        """The keys (parent's chained hash, token ids) of req's blocks that computing positions
        start..end - 1 fills, not cached yet: what the step's update registers (cache_full_blocks).
        None are named where a full block before start went unregistered (a draft skip's)."""
        bs = self.block_size
        first = len(req.block_hashes)
        if not self.enable_prefix_caching or first < start // bs or end // bs <= first:
            return []
        parent, keys = req.block_hashes[-1] if req.block_hashes else chain_root(req.cache_salt), []
        for i in range(first, end // bs):
            key = (parent, tuple(req.token_ids_in(i * bs, (i + 1) * bs)))
            if key not in self.cached:
                keys.append(key)
            parent = chain_hash(*key)
        return keys

    def pending_hit(self, req: Request, filling: set[tuple]) -> int:
        """The tokens of req's prompt past its prefix hit (prefix_blocks) that blocks of `filling`
        (keys_filled of this step's other requests) would add to the hit once computed."""
        if not self.enable_prefix_caching or req.block_ids or not filling:
            return 0
        bs = self.block_size
        found = self.prefix_blocks(req)
        tokens = req.all_token_ids
        parent, n = found[-1][1] if found else chain_root(req.cache_salt), 0
        for i in range(len(found), (len(tokens) - 1) // bs):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            if key not in filling:
                break
            parent = chain_hash(*key)
            n += 1
        return n * bs

    def match_prefix(self, req: Request) -> int:
        """Attach the cached blocks holding a prefix of req's tokens (prefix_blocks); return the
        tokens they cover."""
        found = self.prefix_blocks(req)
        for block, chained in found:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            req.block_ids.append(block)
            req.block_hashes.append(chained)
        return len(found) * self.block_size

    def cache_full_blocks(self, req: Request, limit: int | None = None) -> None:
        """Register req's blocks that became full of computed tokens since the last call (a stop
        inside an accepted run leaves computed positions past the kept tokens: those are not),
        and, with a limit, only those below position `limit`."""
        bs = self.block_size
        if not self.enable_prefix_caching or req.num_computed_tokens < (len(req.block_hashes) + 1) * bs:
            return  # (no block filled since the last call: most decode steps)
        end = min(req.num_computed_tokens, req.num_tokens, req.num_tokens if limit is None else limit)
        for i in range(len(req.block_hashes), end // bs):
            parent = req.block_hashes[-1] if req.block_hashes else chain_root(req.cache_salt)
            key = (parent, tuple(req.token_ids_in(i * bs, (i + 1) * bs)))
            block = req.block_ids[i]
            if key not in self.cached and self.block_keys[block] is None:
                self.cached[key] = block
                self.block_keys[block] = key
            req.block_hashes.append(chain_hash(*key))

    def free(self, req: Request) -> None:
        """Drop req's references; tail blocks go to the eviction queue first."""
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_keys[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free_ids.append(block)
        req.block_ids = []
        req.block_hashes = []

    def _take(self) -> int:
        if self.free_ids:
            block = self.free_ids.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_keys[block]]
            self.block_keys[block] = None
        self.ref_counts[block] = 1
        return block

    def reset_prefix_cache(self) -> None:
        for block in list(self.evictable):
            del self.cached[self.block_keys[block]]
            self.block_keys[block] = None
            self.free_ids.append(block)
        self.evictable.clear()
