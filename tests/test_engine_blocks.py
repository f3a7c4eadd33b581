"""Engine bookkeeping without a model: block pool, KV manager, scheduler.

Exact block ids, reference counts and orders (vLLM test_prefix_caching style).
"""

import pytest
import torch

from rlhf.engine.block_pool import BlockPool, block_key
from rlhf.engine.kv_manager import KVManager
from rlhf.engine.scheduler import Scheduler
from rlhf.engine.sequence import Sequence, Status
from rlhf.engine.types import EngineConfig, EngineConfigError, Request, SamplingParams


def _seq(seq_id, prompt_len, generated=0):
    tokens = list(range(100 * seq_id, 100 * seq_id + prompt_len + generated))
    return Sequence(seq_id, f"r{seq_id}", 0, prompt_len, tokens, SamplingParams(), torch.Generator())


# ---- block pool -------------------------------------------------------------------


def test_pool_allocates_fifo_and_refuses_without_side_effects():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_counts == [1, 1, 1, 0]
    assert pool.allocate(2) is None
    assert pool.num_free == 1 and pool.ref_counts == [1, 1, 1, 0]


def test_pool_freed_blocks_rejoin_the_tail_of_the_free_queue():
    pool = BlockPool(4)
    pool.allocate(3)
    pool.decref(1)
    pool.incref(2)
    pool.decref(2)  # still referenced once
    assert pool.ref_counts == [1, 0, 1, 0]
    assert pool.allocate(2) == [3, 1]
    with pytest.raises(ValueError, match="double free"):
        pool.decref(1) or pool.decref(1)
    with pytest.raises(ValueError, match="is free"):
        BlockPool(2).incref(0)


def test_pool_prefix_map_forgets_a_block_when_it_is_freed():
    pool = BlockPool(3)
    pool.allocate(2)
    h = block_key(None, (1, 2))
    pool.register(0, h)
    pool.register(1, h)  # first registration wins
    assert pool.lookup(h) == 0 and not pool.is_registered(1)
    pool.decref(0)
    assert pool.lookup(h) is None and not pool.is_registered(0)


# ---- KV manager -------------------------------------------------------------------


def test_kv_tables_slots_and_out_of_blocks():
    kv = KVManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots(7, 0, 6) == []
    assert kv.tables[7] == [0, 1]
    assert kv.slots(7, 3, 6) == [3, 4, 5]
    assert kv.allocate_slots(7, 6, 2) == []  # fits in block 1
    assert kv.tables[7] == [0, 1]
    assert kv.allocate_slots(8, 0, 13) is None  # needs 4, 2 free: nothing changes
    assert kv.tables[8] == [] and kv.pool.num_free == 2


def test_kv_fork_shares_all_blocks_and_copies_the_partial_one_on_write():
    kv = KVManager(num_blocks=6, block_size=4)
    kv.allocate_slots(0, 0, 10)  # prompt of 10: blocks [0, 1, 2], block 2 partial
    kv.fork(0, 1)
    kv.fork(0, 2)
    assert kv.pool.ref_counts[:3] == [3, 3, 3]
    assert kv.allocate_slots(1, 10, 1) == [(2, 3)]  # child 1 writes position 10: copy block 2
    assert kv.tables[1] == [0, 1, 3]
    assert kv.allocate_slots(2, 10, 1) == [(2, 4)]
    assert kv.allocate_slots(0, 10, 1) == []  # last holder writes in place
    assert kv.tables[0] == [0, 1, 2]
    assert kv.pool.ref_counts == [3, 3, 1, 1, 1, 0]
    kv.allocate_slots(1, 11, 2)  # crosses into a new block
    assert kv.tables[1] == [0, 1, 3, 5]
    kv.free(1)
    assert kv.pool.ref_counts == [2, 2, 1, 0, 1, 0]


def test_kv_fork_of_a_block_aligned_prompt_needs_no_copy():
    kv = KVManager(num_blocks=4, block_size=4)
    kv.allocate_slots(0, 0, 8)
    kv.fork(0, 1)
    assert kv.allocate_slots(1, 8, 1) == []
    assert kv.tables[1] == [0, 1, 2] and kv.pool.ref_counts == [2, 2, 1, 0]


def test_kv_prefix_match_shares_registered_full_blocks_only():
    kv = KVManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    kv.allocate_slots(0, 0, 10)
    kv.register_full_blocks(0, tokens, 10)  # blocks 0, 1 full; block 2 partial
    assert kv.match_prefix(1, tokens + [99], max_tokens=10) == 8
    assert kv.tables[1] == [0, 1] and kv.pool.ref_counts[:3] == [2, 2, 1]
    # at least one token must be left to compute: an 8-token prompt matches one block
    assert kv.match_prefix(2, tokens[:8], max_tokens=7) == 4
    assert kv.match_prefix(3, [5] + tokens[1:], max_tokens=9) == 0  # first block differs
    kv.free(0)
    kv.free(1)
    kv.free(2)
    assert kv.pool.ref_counts == [0] * 8


# ---- scheduler --------------------------------------------------------------------


def _scheduler(num_blocks=16, block_size=4, budget=8, max_seqs=8, continuous=True):
    return Scheduler(KVManager(num_blocks, block_size), budget, max_seqs, continuous, prefix_sharing=False)


def _advance(out):
    """What the engine does after the forward: mark tokens computed, 'sample' one token when done."""
    for seq, n in out.scheduled:
        seq.num_computed += n
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(0)


def test_scheduler_budget_chunks_prefill_and_admits_in_order():
    s = _scheduler(budget=8)
    a, b, c = _seq(0, 6), _seq(1, 6), _seq(2, 6)
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()
    assert [(q.seq_id, n) for q, n in out.scheduled] == [(0, 6), (1, 2)]
    assert [q.seq_id for q in s.waiting] == [2]
    _advance(out)
    out = s.schedule()  # a decodes 1, b finishes its prompt (4), c gets the remaining 3
    assert [(q.seq_id, n) for q, n in out.scheduled] == [(0, 1), (1, 4), (2, 3)]
    assert s.kv.tables == {0: [0, 1], 1: [2, 3], 2: [4]}


def test_scheduler_preempts_the_newest_and_requeues_it_first():
    s = _scheduler(num_blocks=4, block_size=4, budget=16)
    a, b = _seq(0, 8), _seq(1, 8)
    s.add(a)
    s.add(b)
    _advance(s.schedule())  # both prompts: blocks [0, 1] and [2, 3], pool full
    out = s.schedule()  # a needs a new block for position 8: b is preempted
    assert [q.seq_id for q in out.preempted] == [1]
    assert [(q.seq_id, n) for q, n in out.scheduled] == [(0, 1)]
    assert b.status == Status.WAITING and b.num_computed == 0 and len(b.tokens) == 9  # tokens kept
    assert s.kv.tables[0] == [0, 1, 3] and list(s.waiting) == [b]
    assert s.kv.pool.ref_counts == [1, 1, 0, 1]
    assert s.num_preemptions == 1


def test_scheduler_preempts_itself_when_it_is_the_newest():
    s = _scheduler(num_blocks=3, block_size=4, budget=16)
    a, b = _seq(0, 4), _seq(1, 7)
    s.add(a)
    s.add(b)
    _advance(s.schedule())  # a: [0], b: [1, 2]; full
    a.tokens.extend([0] * 3)  # a now needs a block for positions 4..7 (beyond 1 decode: simulate)
    out = s.schedule()
    assert [q.seq_id for q in out.preempted] == [1]
    assert [(q.seq_id, n) for q, n in out.scheduled] == [(0, 4)]
    s2 = _scheduler(num_blocks=2, block_size=4, budget=16)
    c = _seq(0, 8)
    s2.add_running(c)
    c.tokens.append(1)
    s2.kv.allocate_slots(0, 0, 8)
    c.num_computed = 8
    out = s2.schedule()  # c alone needs a 3rd block: it preempts itself, nothing runs this step
    assert out.scheduled == [] and [q.seq_id for q in out.preempted] == [0]


def test_scheduler_static_batching_waits_for_the_batch_to_drain():
    s = _scheduler(budget=64, max_seqs=2, continuous=False)
    seqs = [_seq(i, 3) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [q.seq_id for q, _ in out.scheduled] == [0, 1]
    _advance(out)
    s.finish(seqs[0])
    out = s.schedule()
    assert [q.seq_id for q, _ in out.scheduled] == [1]  # continuous batching would admit 2 here
    s.finish(seqs[1])
    assert [q.seq_id for q, _ in s.schedule().scheduled] == [2]


def test_scheduler_tiny_pool_finishes_every_sequence():
    """A driver loop with a pool far too small for the batch: all sequences finish, in bounded steps."""
    s = _scheduler(num_blocks=6, block_size=2, budget=5, max_seqs=8)
    seqs = [_seq(i, 3 + i % 3) for i in range(6)]
    target = {q.seq_id: len(q.tokens) + 5 for q in seqs}
    for q in seqs:
        s.add(q)
    done = []
    for _ in range(500):
        _advance(s.schedule())
        for q in list(s.running):
            if len(q.tokens) >= target[q.seq_id]:
                s.finish(q)
                done.append(q.seq_id)
        if not s.running and not s.waiting:
            break
    assert sorted(done) == list(range(6))
    assert s.num_preemptions > 0
    assert s.kv.pool.num_free == 6 and s.kv.tables == {}


def test_configs_name_the_bad_field():
    with pytest.raises(EngineConfigError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(EngineConfigError, match="num_blocks"):
        EngineConfig(num_blocks=0)
    with pytest.raises(EngineConfigError, match="prompt"):
        Request("r", ())
    with pytest.raises(EngineConfigError, match=r"sample_max_new_tokens=\(3,\) is invalid: must be empty or 2 \(n\)"):
        SamplingParams(max_new_tokens=4, n=2, sample_max_new_tokens=(3,))
    with pytest.raises(EngineConfigError, match="limits in \\[1, max_new_tokens\\]"):
        SamplingParams(max_new_tokens=4, n=2, sample_max_new_tokens=(3, 5))


def test_each_sample_stops_at_its_own_length_limit():
    params = SamplingParams(max_new_tokens=6, n=3, sample_max_new_tokens=[2, 6, 1])
    assert params.sample_max_new_tokens == (2, 6, 1)
    assert [params.max_new_tokens_of(i) for i in range(3)] == [2, 6, 1]
    assert SamplingParams(max_new_tokens=6, n=3).max_new_tokens_of(2) == 6
