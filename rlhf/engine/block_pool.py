"""Block pool: ids of the preallocated KV blocks, their reference counts and the prefix map.

Owns bookkeeping only (no tensors). A block is *free* when its reference
count is 0; free blocks are handed out in FIFO order (lowest ids first at
start). A *full* block can be registered in the prefix map under a key made of its
predecessor's block id and its own tokens, so later sequences with the same
prefix can share it instead of recomputing it::

    tokens:  [t0 .. t15][t16 .. t31][t32 t33]      (block_size 16, table [4, 9, 2])
    keys:    (None, blk0)  (4, blk1)  (partial: never registered)

Keys are exact (no hash collisions): a registered block is only reachable
while it is referenced, and whoever references it also references its
predecessor, so a predecessor id always names the same prefix. A block leaves
the prefix map when its last reference is dropped.
"""

from __future__ import annotations

from collections import deque


BlockKey = tuple  # (predecessor block id or None, tokens of the block)


def block_key(parent: int | None, tokens: tuple[int, ...]) -> BlockKey:
    """Prefix-map key of a full block: its predecessor's block id and its tokens."""
    return (parent, tokens)


class BlockPool:
    """``num_blocks`` KV block ids with ref counts, a free queue and a prefix map."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._by_key: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}

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
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._by_key[key]
            self._free.append(block)

    def register(self, block: int, key: BlockKey) -> None:
        """Record a full, computed block under ``key`` (first registration wins)."""
        if key not in self._by_key and block not in self._key_of:
            self._by_key[key] = block
            self._key_of[block] = key

    def lookup(self, key: BlockKey) -> int | None:
        """The block registered under ``key``, if any."""
        return self._by_key.get(key)

    def forget_prefixes(self) -> None:
        """Empty the prefix map (the weights changed: no block computed before may be shared again);
        the blocks stay with the sequences that hold them."""
        self._by_key.clear()
        self._key_of.clear()

    def is_registered(self, block: int) -> bool:
        return block in self._key_of
