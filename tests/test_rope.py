"""rlhf/models/rope.py against megatron's own unfused RoPE (padded and packed), its host syncs, and its
installation into megatron."""

import importlib.util

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from rlhf.models import rope
from rlhf.testing.host_syncs import HostSyncCounter


class _OneRank:
    """A context-parallel group of one, as megatron's THD path asks for."""

    def size(self):
        return 1

    def rank(self):
        return 0


def _freqs(longest: int, width: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.float32) / width))
    angles = torch.outer(torch.arange(longest, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]  # megatron's [s, 1, 1, d] layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rotation_equals_megatrons_unfused_one_bit_for_bit(dtype):
    t = torch.randn(9, 3, 4, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    for width in (16, 8):  # the whole head rotated, and half of it (the rest passes through)
        freqs = _freqs(9, width)
        assert torch.equal(rope.rotate(t, freqs), rope_utils._apply_rotary_pos_emb_bshd(t, freqs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rotation_equals_megatrons_per_sample_split(dtype):
    lengths = [5, 1, 7, 3]
    cu_seqlens = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    t = torch.randn(sum(lengths), 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    freqs = _freqs(max(lengths), 16)
    ours = rope.rotate_packed(t, cu_seqlens, freqs)
    theirs = rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=_OneRank())
    assert torch.equal(ours, theirs)
    # each sample restarts at position 0: its tokens rotate as the same tokens alone in a padded row would
    second = rope.rotate(t[6:13].unsqueeze(1), freqs[:7]).squeeze(1)
    assert torch.equal(ours[6:13], second)
    assert rope.packed_positions(cu_seqlens, 16).tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]


def test_packed_rotation_reads_nothing_on_the_host_where_megatrons_does():
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    t, freqs = torch.randn(9, 2, 8), _freqs(5, 8)
    with HostSyncCounter() as ours:
        rope.rotate_packed(t, cu_seqlens.clone(), freqs)  # a new cu_seqlens: the cached positions are not reused
    with HostSyncCounter() as theirs:
        rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=_OneRank())
    assert ours.events == [] and len(theirs.events) >= 1


def test_unsupported_settings_are_refused_by_name():
    t, freqs = torch.randn(4, 1, 2, 8), _freqs(4, 8)
    with pytest.raises(ValueError, match="interleaved"):
        rope.rotate(t, freqs, interleaved=True)
    with pytest.raises(ValueError, match="context parallelism"):
        rope.rotate_packed(t[:, 0], torch.tensor([0, 4], dtype=torch.int32), freqs, cp_size=2)


def test_install_fills_megatrons_fused_hooks_where_transformer_engine_did_not():
    rope.install()
    if importlib.util.find_spec("transformer_engine") is None:
        assert rope_utils.fused_apply_rotary_pos_emb is rope.rotate
        assert rope_utils.fused_apply_rotary_pos_emb_thd is rope.rotate_packed
    else:  # TE's own fused functions stay
        assert rope_utils.fused_apply_rotary_pos_emb_thd is not rope.rotate_packed
