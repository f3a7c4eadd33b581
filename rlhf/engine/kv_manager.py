"""KV manager: per-sequence block tables on top of the block pool.

Maps a sequence's token positions to KV slots (``slot = block * block_size +
offset``), shares prompt blocks between samples (fork, prefix-map hits) and
copies a shared partially filled block before a sequence writes into it
(copy on write). Out of blocks is *not* an error here: `allocate_slots`
returns ``None`` and changes nothing, and the scheduler decides whom to preempt.
"""

from __future__ import annotations

from rlhf.engine.block_pool import BlockPool, block_key


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class KVManager:
    """Block tables keyed by sequence id."""

    def __init__(self, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}
        self._registered: dict[int, int] = {}  # leading blocks already in the prefix map

    def table(self, seq_id: int) -> list[int]:
        return self.tables.setdefault(seq_id, [])

    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> list[tuple[int, int]] | None:
        """Make room for positions ``[num_computed, num_computed + num_new)``.

        Returns the (src, dst) block copies to perform before writing (copy on
        write of a shared partial block), or None when too few blocks are free
        (nothing is changed then).
        """
        table = self.table(seq_id)
        bs = self.block_size
        need_new = max(0, blocks_for(num_computed + num_new, bs) - len(table))
        cow = num_computed % bs != 0 and self.pool.ref_counts[table[num_computed // bs]] > 1
        fresh = self.pool.allocate(need_new + int(cow))
        if fresh is None:
            return None
        copies = []
        if cow:
            i = num_computed // bs
            src, dst = table[i], fresh.pop()
            self.pool.decref(src)
            table[i] = dst
            copies.append((src, dst))
        table.extend(fresh)
        return copies

    def match_prefix(self, seq_id: int, tokens: list[int], max_tokens: int) -> int:
        """Share registered full blocks of ``tokens[:max_tokens]``; returns tokens now cached.

        Only for a sequence without blocks (new or preempted).
        """
        table = self.table(seq_id)
        assert not table, "match_prefix needs an empty block table"
        bs, parent = self.block_size, None
        for start in range(0, max_tokens - bs + 1, bs):
            block = self.pool.lookup(block_key(parent, tuple(tokens[start:start + bs])))
            if block is None:
                break
            self.pool.incref(block)
            table.append(block)
            parent = block
        self._registered[seq_id] = len(table)
        return len(table) * bs

    def register_full_blocks(self, seq_id: int, tokens: list[int], num_computed: int) -> None:
        """Enter this sequence's newly completed full blocks into the prefix map."""
        table, bs = self.tables[seq_id], self.block_size
        done = self._registered.get(seq_id, 0)
        for i in range(done, num_computed // bs):
            self.pool.register(table[i], block_key(table[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs])))
        self._registered[seq_id] = max(done, num_computed // bs)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (no block is allocated)."""
        for block in self.tables[parent_id]:
            self.pool.incref(block)
        self.tables[child_id] = list(self.tables[parent_id])
        self._registered[child_id] = self._registered.get(parent_id, 0)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references, last block first."""
        for block in reversed(self.tables.pop(seq_id, [])):
            self.pool.decref(block)
        self._registered.pop(seq_id, None)

    def slots(self, seq_id: int, start: int, stop: int) -> list[int]:
        """KV slot of every position in ``[start, stop)``."""
        table, bs = self.tables[seq_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]
