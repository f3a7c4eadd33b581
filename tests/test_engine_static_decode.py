"""Static decode steps with sampling (rlhf/engine/static_decode.py) against the unpadded step, on a stand-in
decoder whose logits rows depend on their own inputs only: the padded step's tokens and log-probs equal
`sample` on the unpadded logits, for sampled (temperature, top-k, top-p, each log-prob mode) and greedy rows,
with buckets reused by smaller steps and one recorded function per bucket and sampling plan."""

import torch

from rlhf.engine.attention import AttentionMeta
from rlhf.engine.decoder import StepInputs
from rlhf.engine.sampler import CDF_CHUNK, SampleInputs, mixed_seed, sample
from rlhf.engine.static_decode import StaticDecode
from rlhf.engine.types import SamplingParams

VOCAB, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 3 * CDF_CHUNK, 4, 40, 6


class RowwiseDecoder:
    """A stand-in for `TPDecoder.logits`: each row's logits [V] a fixed function of its token, position, slot,
    context length and first block, so padding changes no row and a buffer left unfilled changes its row."""

    device = torch.device("cpu")

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.tokens, self.positions = torch.randn(50, VOCAB, generator=g) * 3, torch.randn(30, VOCAB, generator=g)

    def logits(self, inp: StepInputs) -> torch.Tensor:
        meta = inp.attn
        other = (inp.slots * 3 + meta.decode_ctx * 5 + meta.block_tables[:, 0] * 7) % 11
        return (self.tokens[inp.input_ids] + self.positions[inp.positions] + 0.25 * other[:, None])[inp.logits_rows]


def decode_step(rows: int, seed: int) -> StepInputs:
    """A step of ``rows`` sequences decoding one token each, block tables narrower than the model's width."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, 4 * BLOCK_SIZE, (rows,), generator=g)
    tables = torch.randint(0, NUM_BLOCKS, (rows, 4), generator=g, dtype=torch.int32)
    meta = AttentionMeta(list(range(rows)), [1] * rows, ctx.tolist(), tables, list(range(rows)), [],
                         ctx.int(), torch.arange(rows))
    ids = torch.randint(0, 50, (rows,), generator=g)
    slots = torch.randint(0, NUM_BLOCKS * BLOCK_SIZE, (rows,), generator=g)
    return StepInputs(ids, ctx - 1, slots, torch.arange(rows), meta, [])


KINDS = {
    "temperature 1": [SamplingParams(temperature=1.0)],
    "mixed": [SamplingParams(temperature=0.7, top_k=20), SamplingParams(), SamplingParams(temperature=1.3, top_p=0.8),
              SamplingParams(temperature=0.9, top_k=50, top_p=0.9, logprobs_of="sampling"),
              SamplingParams(temperature=1.0, logprobs_of="raw"), SamplingParams(temperature=0.6, top_k=3)],
    "greedy": [SamplingParams()],
}


def test_padded_steps_sample_what_the_unpadded_ones_do():
    static = StaticDecode(RowwiseDecoder(), NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS)
    recorded = set()
    for step, (kind, rows) in enumerate([(k, r) for k in KINDS for r in (8, 5, 3, 1, 7)]):
        params = [KINDS[kind][row % len(KINDS[kind])] for row in range(rows)]
        sampling = SampleInputs.of(params, [mixed_seed(step, row) for row in range(rows)],
                                   [step * 10 + row for row in range(rows)])
        inp = decode_step(rows, step)
        assert StaticDecode.applies(inp)
        want = sample(static.decoder.logits(inp), sampling)
        got = static.run(inp, sampling)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (kind, rows)
        recorded.add((StaticDecode.bucket(rows), sampling.plan))
    assert static.steps == 15 and sorted(static.buckets) == [1, 4, 8]
    assert set(static.graphs) == recorded and len(recorded) == 9  # the steps of 5-8 rows of a plan share one
    static.forget()
    assert not static.buckets and not static.graphs
