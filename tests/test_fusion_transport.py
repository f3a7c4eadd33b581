"""Migration messages: exact round trip of the versioned layout (the K/V and their routing record beside them),
and refusal of cut, foreign-version or invalid messages with the sample named and kept by the sender (2 gloo
ranks, one launch)."""

import dataclasses
import struct

import numpy as np
import pytest
import torch

from rlhf.fusion.transport import HEADER_FIELDS, MigrationFormatError, decode_sequence, encode_sequence
from rlhf.testing.distributed import launch
from scenario_fusion import SENT, other_version, plain, sample


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, x in got.items():
        y = want[name]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None and x.dtype == y.dtype and np.array_equal(x, y), name
        else:
            assert x == y, name


def test_layout_round_trips_exactly():
    state = sample(0, with_kv=True)
    got, kv_spec, routing_spec = decode_sequence(encode_sequence(state))
    assert kv_spec == ((2, 2, 5, 2, 4), torch.float32)
    assert routing_spec == ((5, 2, 3), torch.int16)
    assert_same(plain(dataclasses.replace(got, kv=state.kv, routing=state.routing)), plain(state))
    assert got.params.stop_token_ids == (2, 5) and got.logprobs == state.logprobs  # float64 on the wire: exact


HEADER_BYTES = 8 + 8 * len(HEADER_FIELDS)  # the magic, then int64 fields


@pytest.mark.parametrize("keep, named", [(40, (None, None)), (HEADER_BYTES + 2, (None, 1)), (-3, ("req-1", 1))])
def test_a_cut_message_is_refused_naming_the_sample(keep, named):
    data = encode_sequence(sample(1, with_kv=False))  # the header (152 bytes), then the 5-byte request id
    with pytest.raises(MigrationFormatError, match="truncated") as e:
        decode_sequence(data[:keep])
    assert (e.value.request_id, e.value.sample_index) == named
    if keep == -3:
        assert f"sample 1 of request 'req-1': {len(data) - 3} bytes, its header describes {len(data)}" in str(e.value)


def test_another_version_or_no_magic_is_refused():
    with pytest.raises(MigrationFormatError, match="is version 2; this build reads version 3") as e:
        decode_sequence(other_version(sample(2, with_kv=False)))
    assert e.value.sample_index == 2
    with pytest.raises(MigrationFormatError, match="not a migration message"):
        decode_sequence(b"\x80\x04" + bytes(200))  # e.g. a pickle


def test_routing_goes_only_beside_kv_of_as_many_positions():
    """Without K/V the routing is not sent (the importer computes it again); routing of other positions than the
    K/V's is refused by the sender, and a header announcing routing without K/V by the receiver."""
    state = sample(5, with_kv=True)
    assert decode_sequence(encode_sequence(dataclasses.replace(state, kv=None)))[1:] == (None, None)
    with pytest.raises(ValueError, match=r"want \[positions \(5, as the K/V\), layers, k\]"):
        encode_sequence(dataclasses.replace(state, routing=state.routing[:4]))
    data = bytearray(encode_sequence(state))
    struct.pack_into("<q", data, 8 + 8 * HEADER_FIELDS.index("kv_dtype"), -1)
    with pytest.raises(MigrationFormatError, match="routing of 5 positions with K/V of no positions") as e:
        decode_sequence(bytes(data))
    assert (e.value.request_id, e.value.sample_index) == ("req-5", 5)


@pytest.fixture(scope="module")
def results():
    return launch(2, "scenario_fusion:run", timeout_s=300)


def test_accepted_samples_arrive_exactly_with_and_without_kv(results):
    good = [state for kind, state in SENT if kind == "ok"]
    assert len(results[1]["received"]) == 2
    for got, want in zip(results[1]["received"], good):
        assert_same(got, plain(want))


def test_refused_samples_are_named_by_the_receiver_and_kept_by_the_sender(results):
    errors = results[1]["errors"]
    assert [(rid, index) for rid, index, _ in errors] == [("req-1", 1), ("req-2", 2), ("req-4", 4)]
    assert all(msg.startswith("from rank 0: ") for _, _, msg in errors)
    assert "truncated" in errors[0][2] and "version 2" in errors[1][2] and "sampling params" in errors[2][2]
    kept = results[0]["kept"]
    assert kept[:2] == ["req-1", "req-2"]
    assert kept[2] == "rank 1 refused sample 4 of 'req-4'; it stays with the sender"
    # every sample sent is either received or still held by the sender: none lost, none duplicated
    received = [s["request_id"] for s in results[1]["received"]]
    assert sorted(received + kept[:2] + ["req-4"]) == [f"req-{i}" for i in range(5)]
