"""Block pool: ids of the preallocated KV blocks, their reference counts and the prefix map.

Owns bookkeeping only (no tensors). A block is *free* when its reference
count is 0; free blocks are handed out in FIFO order (lowest ids first at
start). A *full* block can be registered in the prefix map under the hash of
its tokens chained with its predecessor's hash, so later sequences with the
same prefix can share it instead of recomputing it::

    tokens:  [t0 .. t15][t16 .. t31][t32 t33]      (block_size 16)
    hashes:   h0=H(-,blk0) h1=H(h0,blk1)  (partial: never registered)

A block leaves the prefix map when its last reference is dropped.
"""

from __future__ import annotations

from collections import deque


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full block's tokens given the hash of the block before it."""
    return hash((parent, tokens))


class BlockPool:
    """``num_blocks`` KV block ids with ref counts, a free queue and a prefix map."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks with ref count 1, or None (nothing taken) if too few are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        """One more sequence uses ``block`` (prefix sharing)."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free; only allocated blocks can be shared")
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        """One user fewer; at 0 the block leaves the prefix map and rejoins the free queue."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is already free (double free)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            h = self._hash_of.pop(block, None)
            if h is not None:
                del self._by_hash[h]
            self._free.append(block)

    def register(self, block: int, block_hash: int) -> None:
        """Record a full, computed block under ``block_hash`` (first registration wins)."""
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def lookup(self, block_hash: int) -> int | None:
        """The block registered under ``block_hash``, if any."""
        return self._by_hash.get(block_hash)

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of
