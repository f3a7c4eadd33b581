"""HybridFlow Table 2 measured: the bytes each rank receives from rlhf/parallel/reshard.py on gloo ranks.

One 8-rank launch runs both transitions (1-2-2 -> 1-1-2-2 on ranks 0-3 and
1-4-2 -> 1-2-2-2 on all 8), each into HybridFlow's rank order and into the
plain order (tests/scenario_planner.py).
"""

import pytest

from rlhf.models.config import padded_vocab_size
from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.planner.reshard_bytes import hybridflow_fraction, hybridflow_ranks, parallel_bytes, received_bytes
from rlhf.testing.distributed import launch
from scenario_planner import CFG, SLOTS

TRANSITIONS = (  # (name, training p-t-d, generation p_g-t_g-d_g-d as a strategy, ranks, share of M)
    ("1-4-2 -> 1-2-2-2", ParallelStrategy(dp=2, tp=4), ParallelStrategy(dp=4, tp=2), tuple(range(8)), 1 / 4),
    ("1-2-2 -> 1-1-2-2", ParallelStrategy(dp=2, tp=2), ParallelStrategy(dp=4, tp=1), tuple(range(4)), 1 / 2),
)


def _meshes(train, gen, ranks):
    t = TaskMesh("actor_train", ranks, train)
    return t, TaskMesh("actor_gen", hybridflow_ranks(t, gen), gen), TaskMesh("ref_inf", ranks, gen)


def test_hybridflow_order_nests_training_shards():
    t, hf, _ = _meshes(*TRANSITIONS[0][1:4])
    assert hf.ranks == (0, 2, 1, 3, 4, 6, 5, 7)  # HybridFlow Figure 8: TP groups {0, 2}, {1, 3}
    assert hybridflow_ranks(t, ParallelStrategy(dp=2, tp=4)) == tuple(range(8))
    assert hybridflow_ranks(t, ParallelStrategy(dp=1, tp=8)) is None  # t_g = 8 does not divide t = 4
    pp = TaskMesh("actor_train", tuple(range(8)), ParallelStrategy(dp=1, pp=2, tp=4))
    gen = ParallelStrategy(dp=4, pp=1, tp=2)
    nested = received_bytes(CFG, "lm", pp, TaskMesh("actor_gen", hybridflow_ranks(pp, gen), gen))
    plain = received_bytes(CFG, "lm", pp, TaskMesh("actor_gen", tuple(range(8)), gen))
    assert max(nested.values()) < max(plain.values())


@pytest.mark.parametrize("index", [0, 1], ids=[t[0] for t in TRANSITIONS])
def test_hybridflow_formula_analytic(index):
    _, train, gen, ranks, share = TRANSITIONS[index]
    assert hybridflow_fraction(train, gen) == share
    t, hf, _ = _meshes(train, gen, ranks)
    m = parallel_bytes(CFG, "lm", padded_vocab_size(CFG.vocab_size, 1, (train.tp, gen.tp)))
    norms = (2 * CFG.num_layers + 1) * CFG.hidden_size * 2  # replicated, read from another TP index by some ranks
    assert all(n - share * m in (0, norms) for n in received_bytes(CFG, "lm", t, hf).values())


@pytest.fixture(scope="module")
def measured():
    cases = [{"train": {"tp": train.tp}, "gen": {"tp": gen.tp}, "ranks": list(ranks),
              "hybridflow": list(_meshes(train, gen, ranks)[1].ranks)} for _, train, gen, ranks, _ in TRANSITIONS]
    return launch(8, "scenario_planner:run", transitions=cases)


@pytest.mark.parametrize("index", [0, 1], ids=[t[0] for t in TRANSITIONS])
def test_hybridflow_table2_measured_on_gloo(measured, index):
    """Per rank, the real reshard's received tensor-parallel bytes = (tp - t_g p_g) / (t_g p_g tp) x M under
    HybridFlow's grouping; the planner predicts every rank's total (replicated weights included) exactly;
    the plain grouping's worst rank receives M/2 in 1-4-2 -> 1-2-2-2."""
    _, train, gen, ranks, share = TRANSITIONS[index]
    t, hf, plain = _meshes(train, gen, ranks)
    _, hf_slot, plain_slot = SLOTS[index]
    rows = padded_vocab_size(CFG.vocab_size, 1, (train.tp, gen.tp))
    m = parallel_bytes(CFG, "lm", rows) // 2  # bf16 bytes -> elements
    predicted = {hf_slot: received_bytes(CFG, "lm", t, hf), plain_slot: received_bytes(CFG, "lm", t, plain)}
    rows = [r for r in measured if r["rank"] in ranks]
    assert len(rows) == len(ranks)
    for r in rows:
        for slot in (hf_slot, plain_slot):
            assert r[slot]["exact"]
            assert (r[slot]["parallel"] + r[slot]["replicated"]) * 2 == predicted[slot][r["rank"]]
        assert r[hf_slot]["parallel"] == share * m
    assert max(r[plain_slot]["parallel"] for r in rows) == (m / 2 if len(ranks) == 8 else share * m)
