"""Checkpoint storage: roundtrip, crash safety, corruption refusal, retention, RNG, 2 gloo ranks."""
import json
import math
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf.checkpoint import (
    CheckpointError,
    RngHook,
    accelerator_rng_hook,
    capture_rng_state,
    checkpoint_path,
    latest_iteration,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)
from rlhf.checkpoint import storage



def make_shards(seed, ranks=(0, 1)):
    g = torch.Generator().manual_seed(seed)
    return {
        f"model_actor_rank{r}": {
            "embed.weight": torch.randn(8, 4, generator=g),
            "layer.0.bias": torch.randn(4, generator=g).to(torch.bfloat16),
            "steps": torch.arange(5, dtype=torch.int64) + seed,
            "mask": torch.rand(3, generator=g) > 0.5,
            "t_view": torch.randn(4, 6, generator=g).t(),  # non-contiguous input
        }
        for r in ranks
    }


def assert_same(a, b):
    assert a.keys() == b.keys()
    for shard in a:
        assert a[shard].keys() == b[shard].keys()
        for k in a[shard]:
            assert a[shard][k].dtype == b[shard][k].dtype, (shard, k)
            assert torch.equal(a[shard][k], b[shard][k]), (shard, k)


def tmp_entries(root):
    return [n for n in os.listdir(root) if n.startswith(".tmp")]


def save(root, it, seed=None, **kw):
    return save_checkpoint(root, it, shards=make_shards(it if seed is None else seed),
                           state={"iteration_loss": 0.5 * it, "data": {"epoch": 1, "index": it}},
                           **kw)


# ----------------------------------------------------------------------------- roundtrip
def test_roundtrip_tensors_and_state(tmp_path):
    root = str(tmp_path / "ckpt")
    shards = make_shards(42)
    rng = capture_rng_state()
    state = {"lr": 1e-4, "consumed": 1234, "data": {"epoch": 2, "index": 96, "seed": 7},
             "name": "ppo ✓", "flags": [True, None]}
    path = save_checkpoint(root, 42, shards=shards, state=state, json_files={"rng_rank0": rng})
    assert path == checkpoint_path(root, 42) == os.path.join(root, "iter_0000042")
    assert open(os.path.join(root, "latest")).read() == "42\n"
    assert sorted(os.listdir(path)) == ["manifest.json", "model_actor_rank0.safetensors",
                                        "model_actor_rank1.safetensors", "rng_rank0.json",
                                        "state.json"]
    assert tmp_entries(root) == []
    manifest = verify_checkpoint(path)
    assert manifest["iteration"] == 42
    assert {e["name"] for e in manifest["files"]} == set(os.listdir(path)) - {"manifest.json"}

    ck = load_checkpoint(root)
    assert (ck.iteration, ck.path) == (42, path)
    assert ck.state == {**state, "iteration": 42}
    assert ck.json == {"rng_rank0": rng}
    assert_same(ck.tensors, {k: {n: t.contiguous() for n, t in v.items()} for k, v in shards.items()})

    only = load_checkpoint(root, 42, shards=["model_actor_rank1"], json_files=[])
    assert list(only.tensors) == ["model_actor_rank1"] and only.json == {}
    with pytest.raises(CheckpointError, match="no file nope.safetensors in the manifest"):
        load_checkpoint(root, shards=["nope"])


def test_no_checkpoint(tmp_path):
    assert latest_iteration(tmp_path) is None and list_checkpoints(tmp_path / "x") == []
    with pytest.raises(CheckpointError, match=f"no checkpoint in {tmp_path}"):
        load_checkpoint(tmp_path)


def test_latest_and_overwrite(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 3)
    assert latest_iteration(tmp_path) == 3 and list_checkpoints(tmp_path) == [1, 3]
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        save(tmp_path, 3)
    save(tmp_path, 3, seed=99, overwrite=True)
    assert_same(load_checkpoint(tmp_path).tensors, make_shards(99))
    assert load_checkpoint(tmp_path, 1).state["data"]["index"] == 1
    assert tmp_entries(tmp_path) == []


# ----------------------------------------------------------------------------- crash safety
def test_failure_midway_keeps_previous(tmp_path, monkeypatch):
    save(tmp_path, 1)
    real = storage.write_safetensors
    calls = []

    def dying_writer(path, tensors):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        real(path, tensors)

    monkeypatch.setattr(storage, "write_safetensors", dying_writer)
    with pytest.raises(CheckpointError, match="checkpoint 2 in .* not written: rank 0: OSError: disk full"):
        save(tmp_path, 2)
    assert len(calls) == 2
    assert list_checkpoints(tmp_path) == [1] and latest_iteration(tmp_path) == 1
    assert tmp_entries(tmp_path) == []
    assert load_checkpoint(tmp_path).iteration == 1


def test_bad_state_keeps_previous(tmp_path):
    save(tmp_path, 1)
    with pytest.raises(CheckpointError, match="state is not JSON-serialisable"):
        save_checkpoint(tmp_path, 2, state={"x": object()})
    with pytest.raises(CheckpointError, match="shard name 'a/b'"):
        save_checkpoint(tmp_path, 2, shards={"a/b": {}})
    with pytest.raises(CheckpointError, match="entry 'w' must be str -> torch.Tensor"):
        save_checkpoint(tmp_path, 2, shards={"s": {"w": [1.0]}})
    assert list_checkpoints(tmp_path) == [1] and tmp_entries(tmp_path) == []


def test_non_finite_tensors_are_never_written(tmp_path):
    """A NaN in a bf16 tensor, an infinity in a float32 one: one line naming the shard, the tensor and the count;
    nothing of checkpoint 2 is left and checkpoint 1 still loads. Integer and bool tensors are not checked."""
    save(tmp_path, 1)
    for shard, key, dtype, value in (("model_actor_rank0", "layer.0.bias", torch.bfloat16, float("nan")),
                                     ("model_actor_rank1", "embed.weight", torch.float32, float("-inf"))):
        shards = make_shards(2)
        shards[shard][key] = shards[shard][key].clone()
        shards[shard][key][1] = value  # one row: 1 value of the bias, 4 of the embedding
        bad = 1 if shards[shard][key].dim() == 1 else 4
        with pytest.raises(CheckpointError) as info:
            save_checkpoint(tmp_path, 2, shards=shards)
        assert str(info.value) == (
            f"checkpoint 2 in {tmp_path} not written: rank 0: CheckpointError: shard {shard!r}: tensor {key!r} holds "
            f"{bad} NaN or infinite value(s) of {shards[shard][key].numel()}; a checkpoint is never written from "
            "non-finite values")
        assert list_checkpoints(tmp_path) == [1] and latest_iteration(tmp_path) == 1 and tmp_entries(tmp_path) == []
    assert_same(load_checkpoint(tmp_path).tensors, make_shards(1))


def test_a_read_only_directory_fails_with_one_line_and_keeps_previous(tmp_path, monkeypatch):
    """Tests run as root, whom chmod does not stop: the directory refuses the temporary checkpoint's mkdir as a
    read-only one does (PermissionError); the one-line error names the root and the path refused."""
    save(tmp_path, 1)
    real = os.mkdir

    def read_only(path, *args, **kwargs):
        if os.fspath(path).startswith(os.fspath(tmp_path)):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(CheckpointError) as info:
        save(tmp_path, 2)
    message = str(info.value)
    assert message.startswith(f"{tmp_path}: cannot start checkpoint 2: [Errno 13] Permission denied: "
                              f"'{tmp_path}/.tmp_iter_0000002_") and "\n" not in message
    monkeypatch.undo()
    assert list_checkpoints(tmp_path) == [1] and latest_iteration(tmp_path) == 1 and tmp_entries(tmp_path) == []
    assert_same(load_checkpoint(tmp_path).tensors, make_shards(1))


KILL_SCRIPT = textwrap.dedent("""
    import os, torch
    from rlhf.checkpoint import storage
    real, n = storage.write_safetensors, [0]
    def writer(path, tensors):
        n[0] += 1
        if n[0] == {kill_at}:
            os._exit(17)  # hard kill: no cleanup, no exception handlers
        real(path, tensors)
    storage.write_safetensors = writer
    shards = {{f"s{{i}}": {{"w": torch.full((64,), float(i))}} for i in range(3)}}
    storage.save_checkpoint({root!r}, 2, shards=shards, state={{"x": 2}})
""")


def test_killed_process_leaves_previous_loadable(tmp_path):
    root = str(tmp_path)
    save(root, 1)
    script = KILL_SCRIPT.format(root=root, kill_at=3)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 17, proc.stderr
    leftovers = tmp_entries(root)
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp_iter_0000002_")
    assert sorted(os.listdir(os.path.join(root, leftovers[0]))) == ["s0.safetensors", "s1.safetensors"]
    # the partial save is invisible: latest and the directory scan both say 1
    assert latest_iteration(root) == 1 and list_checkpoints(root) == [1]
    ck = load_checkpoint(root, fallback=True)
    assert ck.iteration == 1
    assert_same(ck.tensors, make_shards(1))
    # the next save clears the leftover
    save(root, 2)
    assert tmp_entries(root) == [] and latest_iteration(root) == 2


# ----------------------------------------------------------------------------- corruption
def test_flipped_byte_refused_with_clear_message(tmp_path, caplog):
    save(tmp_path, 1)
    path = save(tmp_path, 2)
    shard = os.path.join(path, "model_actor_rank1.safetensors")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"checkpoint {path}: corrupt: file model_actor_rank1.safetensors sha256 mismatch")
    ck = load_checkpoint(tmp_path, fallback=True)
    assert ck.iteration == 1
    assert any("sha256 mismatch" in r.getMessage() for r in caplog.records)


def test_missing_manifest_and_truncated_file(tmp_path):
    save(tmp_path, 1)
    p2, p3 = save(tmp_path, 2), save(tmp_path, 3)
    os.remove(os.path.join(p3, "manifest.json"))
    with pytest.raises(CheckpointError, match=f"^checkpoint {p3}: incomplete: manifest missing$"):
        load_checkpoint(tmp_path)
    shard = os.path.join(p2, "model_actor_rank0.safetensors")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CheckpointError, match=rf"corrupt: file model_actor_rank0.safetensors is "
                                              rf"{size - 10} bytes, manifest says {size}"):
        load_checkpoint(tmp_path, 2)
    os.remove(os.path.join(p2, "state.json"))
    with pytest.raises(CheckpointError, match="incomplete: file state.json missing"):
        verify_checkpoint(p2, ["state.json"])
    assert load_checkpoint(tmp_path, fallback=True).iteration == 1
    with pytest.raises(CheckpointError, match="incomplete: directory missing"):
        load_checkpoint(tmp_path, 7)


def test_fallback_when_all_broken(tmp_path):
    p1 = save(tmp_path, 1)
    os.remove(os.path.join(p1, "manifest.json"))
    with pytest.raises(CheckpointError, match="no complete checkpoint in .*manifest missing"):
        load_checkpoint(tmp_path, fallback=True)
    open(os.path.join(tmp_path, "latest"), "w").write("garbage")
    with pytest.raises(CheckpointError, match="expected an iteration number"):
        load_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- retention
def test_keep_last(tmp_path):
    for it in range(1, 6):
        save(tmp_path, it, keep_last=2)
    assert list_checkpoints(tmp_path) == [4, 5] and latest_iteration(tmp_path) == 5
    assert tmp_entries(tmp_path) == []
    # latest is never pruned, even when it is not among the newest
    save(tmp_path, 9)
    open(os.path.join(tmp_path, "latest"), "w").write("4\n")
    assert prune_checkpoints(tmp_path, 1) == [5]
    assert list_checkpoints(tmp_path) == [4, 9]
    with pytest.raises(CheckpointError, match="keep_last=0"):
        save(tmp_path, 10, keep_last=0)


def test_a_save_the_disk_cannot_hold_is_refused_before_writing(tmp_path, monkeypatch):
    """Free space under the newest checkpoint's size: one line saying both, nothing written, the previous
    checkpoint still loads and ``latest`` still names it."""
    save(tmp_path, 1)
    with open(os.path.join(checkpoint_path(tmp_path, 1), "manifest.json")) as f:
        size = sum(e["bytes"] for e in json.load(f)["files"])
    usage = storage.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: usage._replace(free=size - 1))
    with pytest.raises(CheckpointError, match=r"cannot start checkpoint 2: .* GiB free, but the last checkpoint "
                                              r"took .* GiB; free some space \(--keep-last N"):
        save(tmp_path, 2)
    assert list_checkpoints(tmp_path) == [1] and latest_iteration(tmp_path) == 1 and tmp_entries(tmp_path) == []
    assert load_checkpoint(tmp_path).iteration == 1
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: usage._replace(free=size))
    save(tmp_path, 2)
    assert latest_iteration(tmp_path) == 2


# ----------------------------------------------------------------------------- RNG
def draws():
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(),
            torch.rand(3).tolist())


def test_rng_capture_restore_through_json():
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    box = {"v": [1, 2]}
    hook = RngHook("fake", get_state=lambda: list(box["v"]), set_state=lambda v: box.update(v=v))
    state = json.loads(json.dumps(capture_rng_state([hook])))
    expected = draws()
    box["v"] = [9]
    restore_rng_state(state, [hook])
    assert draws() == expected
    assert box["v"] == [1, 2]
    with pytest.raises(CheckpointError, match="no saved RNG state for hook 'other'"):
        restore_rng_state(state, [RngHook("other", list, print)])
    assert accelerator_rng_hook() is None or accelerator_rng_hook().name == "accelerator"


# ----------------------------------------------------------------------------- 2 gloo ranks
def _two_rank_worker(rank, init_file, root):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = dist.group.WORLD
    try:
        mine = make_shards(10 + rank, ranks=(rank,))
        torch.manual_seed(rank)
        rng = capture_rng_state()
        path = save_checkpoint(root, 1, shards=mine, json_files={f"rng_rank{rank}": rng},
                               state={"data": {"epoch": 0, "index": 8}, "from": rank}, group=group)
        assert path == checkpoint_path(root, 1)
        ck = load_checkpoint(root, shards=[f"model_actor_rank{rank}"],
                             json_files=[f"rng_rank{rank}"], group=group)
        assert ck.iteration == 1 and ck.state["from"] == 0  # state comes from rank 0
        assert_same(ck.tensors, mine)
        assert ck.json[f"rng_rank{rank}"] == rng

        # rank 1 fails mid-save: every rank raises, checkpoint 1 stays latest
        real = storage.write_safetensors

        def failing(p, t):
            if rank == 1:
                raise OSError("rank 1 disk full")
            real(p, t)

        storage.write_safetensors = failing
        try:
            save_checkpoint(root, 2, shards=make_shards(20 + rank, ranks=(rank,)), group=group)
            raise AssertionError("save should have failed")
        except CheckpointError as e:
            assert "rank 1: OSError: rank 1 disk full" in str(e), str(e)
        finally:
            storage.write_safetensors = real
        # two ranks writing one shard name is refused, not silently clobbered
        try:
            save_checkpoint(root, 2, shards={"same": {"w": torch.zeros(2)}}, group=group)
            raise AssertionError("save should have failed")
        except CheckpointError as e:
            assert "same.safetensors written by two ranks" in str(e), str(e)
        # rank 1's weights hold a NaN: every rank raises the line naming rank 1's shard and tensor
        try:
            save_checkpoint(root, 2, shards={f"w{rank}": {"w": torch.full((2,), math.nan if rank else 0.0)}},
                            group=group)
            raise AssertionError("save should have failed")
        except CheckpointError as e:
            assert str(e).endswith("not written: rank 1: CheckpointError: shard 'w1': tensor 'w' holds 2 NaN or "
                                   "infinite value(s) of 2; a checkpoint is never written from non-finite values"), e
        dist.barrier(group)
        assert latest_iteration(root) == 1 and list_checkpoints(root) == [1]
        left = [(n, os.listdir(os.path.join(root, n))) for n in os.listdir(root) if n.startswith(".tmp_iter")]
        assert left == [], left
        dist.barrier(group)  # rank 0 starts a solo save next; finish looking first

        # a corrupt shard of the *other* rank is caught by rank 0's full check
        if rank == 0:
            save_checkpoint(root, 2, shards=make_shards(2), state={})
            with open(os.path.join(checkpoint_path(root, 2), "model_actor_rank1.safetensors"),
                      "r+b") as f:
                f.seek(100)
                b = f.read(1)
                f.seek(100)
                f.write(bytes([b[0] ^ 0xFF]))
        dist.barrier(group)
        try:
            load_checkpoint(root, shards=["model_actor_rank0"], group=group)
            raise AssertionError("load should have failed")
        except CheckpointError as e:
            assert "model_actor_rank1.safetensors sha256 mismatch" in str(e), str(e)
        ck = load_checkpoint(root, shards=[f"model_actor_rank{rank}"], json_files=[],
                             fallback=True, group=group)
        assert ck.iteration == 1
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks(tmp_path):
    root = str(tmp_path / "ckpt")
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), root), nprocs=2, join=True)


def test_failure_after_rename_is_reported(tmp_path, monkeypatch):
    save(tmp_path, 1)

    def no_latest(root, iteration):
        raise OSError("read-only file system (simulated)")

    monkeypatch.setattr(storage, "write_latest", no_latest)
    with pytest.raises(CheckpointError, match="iter_0000002 was written but 'latest' was not updated"):
        save(tmp_path, 2)
    monkeypatch.undo()
    assert latest_iteration(tmp_path) == 1  # the commit record still names 1
    assert load_checkpoint(tmp_path).iteration == 1
    assert load_checkpoint(tmp_path, 2).iteration == 2  # complete, loadable by number
