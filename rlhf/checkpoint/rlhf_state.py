"""RLHF training state on disk: model weights, AdamW states, schedulers, data position, RNG.

Layout-free format on top of :mod:`rlhf.checkpoint.storage` (atomic, verified).
Every tensor is stored FULL (unsharded) under its global name, one file per
(model, pipeline stage of the saving layout)::

    iter_0000042/
      actor_stage0of2.safetensors     stage 0's params + "exp_avg/<n>", "exp_avg_sq/<n>", "step/<n>"
      actor_stage0of2_meta.json       {"config", "role", "pp", "param_groups", "scheduler"}
      actor_stage1of2.safetensors
      actor_stage1of2_meta.json
      rng_rank{r}.json                per-rank RNG of the saving job
      state.json                      {"iteration", "data_position", "extra"}

An optimizer is a ``rlhf.optim.ModelOptimizer`` (megatron; its scheduler is
``optimizer.scheduler``) or a plain torch optimizer. Its state per parameter
is found through ``StateSlice``s: the whole (TP-sharded) parameter, or with
megatron's distributed optimizer this DP rank's range of the flattened
parameter. A bf16 or fp16 trained model's saved weights are its optimizer's fp32
main weights (the model's own are those rounded), so resuming is exact.

Saving: with a distributed optimizer the DP ranks first all-reduce each
parameter's moments (zeros outside a rank's range) into whole TP shards; then
the TP ranks of data-parallel replica 0 all-gather each stage's parameters and
moments (sharded exactly like the parameter); the replica's TP rank 0 writes
them, without padded vocabulary rows (rlhf.models.vocab: the saved shapes
are the model's own, whatever tp and padding saved them; loading pads with
zeros again). Loading into any (tp, pp, dp) and either optimizer: a rank finds each of
its parameters' files with ``owning_stage(name, num_layers, saved pp)``, reads
just those tensors (``safe_open``), slices them with ``full_to_shard`` and
keeps its ``StateSlice`` range. ``groups=None`` means an unsharded model in a
single process.

A model with LoRA adapters (``model.lora_config``) saves only what it trains (adapters, modules_to_save, a
critic's value head) and their optimizer state; its meta's ``"base"`` records where the frozen base came
from (``ModelSlot.base_source``: the starting model's directory, None for weights given in memory or drawn
at random) and the sha256 and shape of every frozen tensor (full, without vocabulary padding, as fp32), so
that loading it into a model whose base differs is refused (:class:`BaseMismatchError`), and so that
:func:`rlhf.checkpoint.sources.read_full_state` can fill the base in from the source for exports
(:func:`read_saved_state` reads what the checkpoint holds and says which base tensors it lacks).

A format module: of rlhf.checkpoint it imports only storage and rng; sources.py and the conversions
(convert.py) sit above it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from rlhf.checkpoint import rng, storage
from rlhf.models.config import ModelConfig
from rlhf.models.naming import expert_index, named_global_parameters, owning_stage
from rlhf.models.sharding import ShardSpec, full_to_shard
from rlhf.models.vocab import drop_vocab_padding, fit_vocab_rows
from rlhf.optim import StateSlice
from rlhf.parallel.reshard import gather_experts, gather_tp_full

MOMENTS = ("exp_avg", "exp_avg_sq")
TOKENIZER_DIR = "tokenizer"
"""``<root>/tokenizer``: the tokenizer files of a converted HF model (beside ``latest``, outside iter_*)."""


@dataclass
class ModelSlot:
    """One model of the RLHF state as this rank holds it (``model=None``: not on this rank)."""

    config: ModelConfig
    role: str = "lm"
    model: Optional[torch.nn.Module] = None
    groups: Any = None  # TaskGroups, or None for an unsharded single-process model
    optimizer: Any = None  # a rlhf.optim.ModelOptimizer or a torch optimizer
    scheduler: Any = None  # anything with state_dict() / load_state_dict() (ModelOptimizer.scheduler)
    lora: Any = None  # the LoRAConfig of adapters in ``full`` without a model (else the model's lora_config)
    base_source: Optional[str] = None  # where a LoRA model's frozen base came from (recorded, not read)


class BaseMismatchError(storage.CheckpointError):
    """A checkpoint of adapters does not fit the frozen base it is loaded onto, or its base cannot be read."""


BASE_DIGEST = "rlhf_base_digest"
"""Attribute of a frozen parameter of a LoRA model: its `base_digest`, kept from the first save on (every TP
rank of a replica saves together, so all of them skip the gather together)."""


def base_digest(full: torch.Tensor) -> dict:
    """{"shape", "sha256"} of a full frozen tensor (its fp32 bytes): a LoRA checkpoint's record of its base."""
    data = full.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return {"shape": list(full.shape), "sha256": hashlib.sha256(data).hexdigest()}


def saves_base(slot: ModelSlot) -> bool:
    """Whether the slot's frozen weights go into its checkpoint files: all but a LoRA model's."""
    return getattr(slot.model, "lora_config", None) is None


@dataclass
class LoadedRlhfState:
    """What :func:`load_rlhf_state` returns besides filling the slots in place."""

    iteration: int
    path: str
    data_position: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


def _layout(slot: ModelSlot) -> tuple[int, int, int, int, int]:
    """(tp, tp_rank, pp, stage, dp_rank) of this rank in the slot's layout."""
    g = slot.groups
    if g is None:
        return 1, 0, 1, 0, 0
    return g.mesh.strategy.tp, g.tp_rank, g.mesh.strategy.pp, g.coord.pp, g.coord.dp


def _rng_hooks() -> list[rng.RngHook]:
    """The accelerator's RNG hook, when there is an accelerator (saved and restored per rank)."""
    hook = rng.accelerator_rng_hook()
    return [hook] if hook is not None else []


def shard_name(model_name: str, stage: int, pp: int) -> str:
    return f"{model_name}_stage{stage}of{pp}"


def _state_slices(optimizer) -> tuple[dict, Any]:
    """(model parameter -> StateSlice, the group its state is sharded over or None) of ``optimizer``."""
    if optimizer is None:
        return {}, None
    if isinstance(optimizer, torch.optim.Optimizer):
        return {p: StateSlice(optimizer, p, 0, p.numel()) for g in optimizer.param_groups for p in g["params"]}, None
    return optimizer.state_slices(), optimizer.shard_group


@torch.no_grad()
def _local_state(slot: ModelSlot, slices: dict, group) -> dict[str, torch.Tensor]:
    """This rank's TP shard of every moment ("<key>/<name>"), the step ("step/<name>") and, for a bf16 or
    fp16 parameter, its fp32 main weights ("main/<name>").

    Empty before the first step (a low-precision model's weights are then exactly its main weights). With a
    sharded optimizer (``group``: its DP group; collective) every DP rank adds its range into zeros,
    all-reduced.
    """
    states = {p: s.owner.state.get(s.inner, {}) for p, s in slices.items()}
    device = next(slot.model.parameters()).device
    step = torch.tensor(max((float(st["step"]) for st in states.values() if "step" in st), default=0.0),
                        device=device)
    if group is not None:
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group)
    if step.item() == 0:  # host sync, once per model and save
        return {}
    keys = MOMENTS if "betas" in slot.optimizer.param_groups[0] else ()  # AdamW's moments; the same on every rank
    out = {}
    for name, param in named_global_parameters(slot.model).items():
        st, s = states.get(param, {}), slices.get(param)
        if group is None and "step" not in st:
            continue
        sources = {key: st.get(key) for key in keys}
        if param.dtype != torch.float32:
            sources["main"] = None if s is None else s.inner
        for key, value in sources.items():
            flat = torch.zeros(param.numel(), dtype=torch.float32, device=device)
            if value is not None:
                flat[s.start:s.end] = value.reshape(-1)
            if group is not None:
                dist.all_reduce(flat, group=group)
            out[f"{key}/{name}"] = flat.view_as(param)
        out[f"step/{name}"] = step.clone()
    return out


def _stage_tensors(slot: ModelSlot, state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(full params (the fp32 main weights where ``state`` has them) and optimizer ``state`` of this rank's
    stage, without padded vocabulary rows; the digests of a LoRA model's frozen params, which are left out)
    (TP ranks of one replica call together)."""
    tp = _layout(slot)[0]
    tp_group = slot.groups.tp if slot.groups is not None else None
    vocab = slot.config.vocab_size
    out, base = {}, {}
    for name, param in named_global_parameters(slot.model).items():
        frozen = not saves_base(slot) and not param.requires_grad
        if frozen and hasattr(param, BASE_DIGEST):  # the base never changes: gathered and hashed at the first save
            base[name] = getattr(param, BASE_DIGEST)
            continue
        spec = ShardSpec.of(param, tp)
        weights = state.get(f"main/{name}", param.data)
        full = drop_vocab_padding(name, gather_tp_full(weights, spec, tp_group), vocab)
        if frozen:
            base[name] = base_digest(full)
            setattr(param, BASE_DIGEST, base[name])
            continue
        out[name] = full
        for key in MOMENTS:
            if f"{key}/{name}" in state:
                out[f"{key}/{name}"] = drop_vocab_padding(name, gather_tp_full(state[f"{key}/{name}"], spec, tp_group),
                                                          vocab)
        if f"step/{name}" in state:
            out[f"step/{name}"] = state[f"step/{name}"]
    return out, base


def _gather_expert_entries(tensors: dict, ep_group) -> None:
    """Add every expert's entries (weights, ``<key>/`` moments and steps) to this rank's ``tensors`` from the
    ranks of ``ep_group`` (collective over it)."""
    local: dict[str, dict] = {}
    for key, tensor in tensors.items():
        prefix, _, name = key.rpartition("/")
        if expert_index(name) is not None:
            local.setdefault(prefix, {})[name] = tensor
    for prefix, entries in sorted(local.items()):
        for name, tensor in gather_experts(entries, ep_group).items():
            tensors[f"{prefix}/{name}" if prefix else name] = tensor


def _meta(slot: ModelSlot, pp: int, base: Optional[dict] = None) -> dict:
    groups = []
    if slot.optimizer is not None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in slot.optimizer.param_groups]
    lora = slot.lora if slot.lora is not None else getattr(slot.model, "lora_config", None)
    meta = {"config": slot.config.to_dict(), "role": slot.role, "pp": pp, "param_groups": groups,
            "scheduler": slot.scheduler.state_dict() if slot.scheduler is not None else None,
            "lora": None if lora is None else dataclasses.asdict(lora)}
    if base is not None:
        meta["base"] = {"source": slot.base_source, "tensors": base}
    return meta


def stage_files(model_name: str, slot: ModelSlot, tensors: dict, stage: int = 0, pp: int = 1,
                base: Optional[dict] = None):
    """(shards, json_files) entries of one stage, as :func:`storage.save_checkpoint` takes them; ``base``:
    the digests of the frozen tensors left out (a LoRA model's stage)."""
    name = shard_name(model_name, stage, pp)
    return {name: tensors}, {name + "_meta": _meta(slot, pp, base)}


def save_model(root: str, iteration: int, model_name: str, config: ModelConfig, role: str,
               full: dict[str, torch.Tensor], extra: Optional[dict] = None, lora=None) -> str:
    """Write one model's full weights (global names; with ``lora``, a LoRAConfig, its adapters too) as
    checkpoint ``iteration`` of a root, in this process alone (a converted model: no optimizer, no data
    position); returns its directory."""
    shards, json_files = stage_files(model_name, ModelSlot(config, role, lora=lora), full)
    return storage.save_checkpoint(root, iteration, shards=shards, json_files=json_files,
                                   state={"data_position": {}, "extra": dict(extra or {})})


def save_rlhf_state(root: str, iteration: int, slots: Mapping[str, ModelSlot], *,
                    data_position: Optional[dict] = None, extra: Optional[dict] = None,
                    group=None, keep_last: Optional[int] = None) -> str:
    """Save every model's weights + optimizer + scheduler, the data position and RNG (collective).

    Every rank of ``group`` (all ranks holding any model; ``None``: this process
    alone) calls this with the same slot names. Returns the checkpoint directory.
    """
    shards, json_files = {}, {}
    for model_name, slot in slots.items():
        if slot.model is None:
            continue
        tp, tp_rank, pp, stage, dp_rank = _layout(slot)
        ep = slot.groups.mesh.strategy.ep if slot.groups is not None else 1
        slices, shard_group = _state_slices(slot.optimizer)
        if dp_rank >= ep and shard_group is None:
            continue
        opt_state = _local_state(slot, slices, shard_group)
        if dp_rank >= ep:
            continue
        tensors, base = _stage_tensors(slot, opt_state)
        if ep > 1:  # replica 0's EP group holds every expert
            _gather_expert_entries(tensors, slot.groups.pg_collection.ep)
        if tp_rank == 0 and dp_rank == 0:
            s, j = stage_files(model_name, slot, tensors, stage, pp, None if saves_base(slot) else base)
            shards.update(s)
            json_files.update(j)
    rank = dist.get_rank(group) if group is not None else 0
    json_files[f"rng_rank{rank}"] = rng.capture_rng_state(_rng_hooks())
    state = {"data_position": dict(data_position or {}), "extra": dict(extra or {})}
    return storage.save_checkpoint(root, iteration, shards=shards, state=state, json_files=json_files,
                                   group=group, keep_last=keep_last)


# --------------------------------------------------------------------------- loading
def saved_models(manifest: dict) -> dict[str, int]:
    """model name -> saved pp, from the ``*_stage0of{pp}_meta.json`` files."""
    out = {}
    for entry in manifest["files"]:
        name = entry["name"]
        if name.endswith("_meta.json") and "_stage0of" in name:
            model, pp = name[: -len("_meta.json")].rsplit("_stage0of", 1)
            out[model] = int(pp)
    return out


def _read_stage_tensors(path: str, model_name: str, pp: int, num_layers: int,
                        keys: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Read ``keys`` ((param global name, stored key)) from the files of their owning stages."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, key in keys:
        fname = shard_name(model_name, owning_stage(name, num_layers, pp), pp) + storage.TENSOR_EXT
        by_file.setdefault(fname, []).append(key)
    storage.verify_checkpoint(path, sorted(by_file))
    out = {}
    for fname, wanted in by_file.items():
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            present = set(f.keys())
            out.update({k: f.get_tensor(k) for k in wanted if k in present})
    return out


@dataclass(frozen=True)
class MissingBase:
    """The frozen tensors a read asked for that a base-free LoRA checkpoint left out: where the run that saved
    it took its base from (``source``: a model directory, None for a base given in memory) and their recorded
    digests (name -> {"shape", "sha256"})."""

    path: str
    model_name: str
    source: Optional[str]
    digests: dict

    @property
    def _what(self) -> str:
        return f"checkpoint {self.path}: model {self.model_name!r} holds its LoRA adapters, not its frozen base"

    def source_dir(self) -> str:
        """The recorded base directory to read the tensors from; BaseMismatchError when none was recorded."""
        if self.source is None:
            raise BaseMismatchError(f"{self._what}, and the run that saved it was given its base in memory (no "
                                    "model directory recorded); nothing to read the base from")
        return self.source

    def unreadable(self, problem: Exception) -> BaseMismatchError:
        """The error for a recorded base that could not be read (``problem``: why)."""
        return BaseMismatchError(f"{self._what}; reading it from the recorded base {self.source} failed: {problem}")

    def verify(self, full: Mapping[str, torch.Tensor]) -> None:
        """BaseMismatchError unless ``full`` (read from the recorded base) holds every wanted tensor as
        recorded."""
        for name, saved in self.digests.items():
            problem = _base_differs(name, base_digest(full[name]), saved)
            if problem:
                raise BaseMismatchError(f"{self._what}; the recorded base {self.source} has changed since: {problem}")


def read_saved_state(root: str, model_name: str, iteration: Optional[int] = None, names=None
                     ) -> tuple[ModelConfig, str, dict[str, torch.Tensor], Optional[MissingBase]]:
    """(config, role, the tensors the checkpoint holds by global name, the frozen tensors it left out) of one
    saved model, in this process alone.

    ``names`` limits what is read (default: every weight of the model). The last item is None unless a LoRA
    model saved without its base lacks some of ``names``: filling those in is
    :func:`rlhf.checkpoint.sources.read_full_state`'s.
    """
    path, meta = _resolve_model(root, model_name, iteration)
    cfg = ModelConfig.from_dict(meta["config"])
    base = saved_base(path, model_name, meta)
    stored = _all_names(path, model_name, meta["pp"])
    if names is None:
        names = stored + sorted(base)
    full = _read_stage_tensors(path, model_name, meta["pp"], cfg.num_layers, [(n, n) for n in names if n in stored])
    wanted = {n: base[n] for n in names if n in base}
    missing = MissingBase(path, model_name, meta["base"]["source"], wanted) if wanted else None
    return cfg, meta["role"], full, missing


def saved_base(path: str, model_name: str, meta: dict) -> dict:
    """name -> {"shape", "sha256"} of the frozen tensors a LoRA model's checkpoint left out (every stage's);
    empty for a checkpoint that holds its whole model."""
    if "base" not in meta:
        return {}
    out = {}
    for stage in range(meta["pp"]):
        out.update(_read_json(path, shard_name(model_name, stage, meta["pp"]) + "_meta.json")["base"]["tensors"])
    return out


def _base_differs(name: str, now: dict, saved: dict) -> Optional[str]:
    """What differs between frozen tensor ``name``'s digest ``now`` and the checkpoint's, or None."""
    if now == saved:
        return None
    return (f"{name} is {tuple(now['shape'])} with sha256 {now['sha256'][:12]}..., the adapters were trained on "
            f"{tuple(saved['shape'])} with sha256 {saved['sha256'][:12]}...")


def saved_model_config(root: str, model_name: str, iteration: Optional[int] = None) -> tuple[ModelConfig, str]:
    """(config, role) of a model in a checkpoint (``latest`` by default), without reading tensors."""
    _, meta = _resolve_model(root, model_name, iteration)
    return ModelConfig.from_dict(meta["config"]), meta["role"]


def saved_lora_config(root: str, model_name: str, iteration: Optional[int] = None):
    """The LoRAConfig of a saved model's adapters (``latest`` by default), None when it has none."""
    from rlhf.models.config import LoRAConfig

    lora = _resolve_model(root, model_name, iteration)[1].get("lora")
    return None if lora is None else LoRAConfig(**{k: tuple(v) if isinstance(v, list) else v
                                                   for k, v in lora.items()})


def _resolve_model(root: str, model_name: str, iteration: Optional[int]) -> tuple[str, dict]:
    """(verified checkpoint directory, model meta) of ``model_name`` (``latest`` when ``iteration`` is None)."""
    path = storage.checkpoint_path(root, storage.resolve_checkpoint(root, iteration))
    return path, _model_meta(path, model_name)


def _model_meta(path: str, model_name: str) -> dict:
    manifest = storage.verify_checkpoint(path, [])
    saved = saved_models(manifest)
    if model_name not in saved:
        raise storage.CheckpointError(f"checkpoint {path}: no model {model_name!r} (models: {sorted(saved)})")
    return _read_json(path, shard_name(model_name, 0, saved[model_name]) + "_meta.json")


def _read_json(path: str, fname: str):
    """A JSON file of checkpoint ``path``, checked against the manifest first."""
    storage.verify_checkpoint(path, [fname])
    with open(os.path.join(path, fname), encoding="utf-8") as f:
        return json.load(f)


def _all_names(path: str, model_name: str, pp: int) -> list[str]:
    from safetensors import safe_open

    names = []
    for stage in range(pp):
        with safe_open(os.path.join(path, shard_name(model_name, stage, pp) + storage.TENSOR_EXT), "pt") as f:
            names += [k for k in f.keys() if "/" not in k]
    return names


@torch.no_grad()
def _check_base(path: str, model_name: str, slot: ModelSlot, base: dict) -> Optional[str]:
    """Why the slot's frozen weights are not the base its checkpoint's adapters were trained on (recorded as
    ``base``), or None (TP ranks of the slot call together)."""
    tp, tp_group = _layout(slot)[0], slot.groups.tp if slot.groups is not None else None
    for name, param in named_global_parameters(slot.model).items():
        if name not in base:
            continue
        full = drop_vocab_padding(name, gather_tp_full(param.data, ShardSpec.of(param, tp), tp_group),
                                  slot.config.vocab_size)
        problem = _base_differs(name, base_digest(full), base[name])
        if problem:
            return (f"checkpoint {path}: model {model_name!r} holds LoRA adapters trained on another base than "
                    f"the one loaded now (start from the base the run was launched with): {problem}")
    return None


@torch.no_grad()
def _load_slot(path: str, model_name: str, slot: ModelSlot) -> Optional[str]:
    """Fill one slot's weights, optimizer moments and scheduler from checkpoint ``path``; returns why the
    model's frozen base does not fit the checkpoint's adapters (None: it does, or the checkpoint holds the
    whole model), having loaded nothing then."""
    meta = _model_meta(path, model_name)
    saved_cfg = ModelConfig.from_dict(meta["config"])
    if saved_cfg != slot.config:
        raise storage.CheckpointError(f"checkpoint {path}: model {model_name!r} was saved with {saved_cfg}, "
                                      f"the model to load into has {slot.config}")
    tp, tp_rank = _layout(slot)[:2]
    base = saved_base(path, model_name, meta)
    if base:
        problem = _check_base(path, model_name, slot, base)
        if problem:
            return problem
    params = {n: p for n, p in named_global_parameters(slot.model).items() if n not in base}
    keys = [(n, n) for n in params]
    if slot.optimizer is not None:
        keys += [(n, f"{k}/{n}") for n in params for k in (*MOMENTS, "step")]
    full = _read_stage_tensors(path, model_name, meta["pp"], saved_cfg.num_layers, keys)
    for name, param in params.items():
        param.data.copy_(_shard(full[name], name, param, tp, tp_rank))
    if slot.optimizer is not None:
        _load_optimizer(slot, params, full, meta["param_groups"], tp, tp_rank)
    if slot.scheduler is not None and meta["scheduler"] is not None:
        slot.scheduler.load_state_dict(meta["scheduler"])
    return None


def _shard(full: torch.Tensor, name: str, param: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of saved tensor ``full`` of parameter ``name`` (weight or moment),
    the model's padded vocabulary rows (zeros) added first."""
    spec = ShardSpec.of(param, tp)
    return full_to_shard(fit_vocab_rows(name, full, spec.full_size(param)), spec, tp_rank)


def _load_optimizer(slot: ModelSlot, params: dict, full: dict, saved_groups: list, tp: int, tp_rank: int) -> None:
    """Restore the optimizer's hyper-parameters and, for what it holds on this rank, its state."""
    groups = slot.optimizer.param_groups
    for group, saved in zip(groups, _matching_groups(groups, saved_groups)):
        group.update(saved)
    slices, _ = _state_slices(slot.optimizer)
    for name, param in params.items():
        s = slices.get(param)
        if s is not None and s.inner is not param:  # a bf16/fp16 model's fp32 main weights, from the saved ones
            flat = _shard(full[name], name, param, tp, tp_rank).reshape(-1)
            s.inner.copy_(flat[s.start:s.end].view_as(s.inner))
        if s is None or f"step/{name}" not in full:
            continue
        state = {"step": full[f"step/{name}"].clone()}
        for key in MOMENTS:
            if f"{key}/{name}" in full:
                flat = _shard(full[f"{key}/{name}"], name, param, tp, tp_rank).reshape(-1)
                state[key] = flat[s.start:s.end].view_as(s.inner).to(s.inner, copy=True)
        s.owner.state[s.inner] = state


def _matching_groups(groups: list, saved: list) -> list:
    """The saved hyper-parameters of each of ``groups``: group by group, or, where the saving layout split its
    parameters otherwise (a mixture of experts' expert optimizer exists only with expert parallelism), the saved
    group of the same weight-decay multiplier (every group follows one LR schedule), less what says which
    parameters the group holds."""
    if len(saved) == len(groups):
        return saved
    by_decay = {group.get("wd_mult"): {k: v for k, v in group.items() if k != "is_expert_parallel"}
                for group in reversed(saved)}
    if any(group.get("wd_mult") not in by_decay for group in groups):
        raise storage.CheckpointError(f"optimizer has {len(groups)} param groups, the checkpoint {len(saved)}")
    return [by_decay[group.get("wd_mult")] for group in groups]


def load_rlhf_state(root: str, slots: Mapping[str, ModelSlot], iteration: Optional[int] = None, *,
                    group=None, restore_rng: bool = True, fallback: bool = False) -> LoadedRlhfState:
    """Load into ``slots`` (any layout), returning iteration, data position and extra state.

    Collective over ``group``. Only verified checkpoints are read; ``iteration=None``
    takes ``latest`` (``fallback=True``: the newest complete one if that is broken).
    RNG is restored for this rank when the checkpoint has ``rng_rank{rank}``.
    """
    it = storage.resolve_checkpoint(root, iteration, fallback=fallback, group=group)
    path = storage.checkpoint_path(root, it)
    problems = [_load_slot(path, model_name, slot) for model_name, slot in slots.items() if slot.model is not None]
    problems = [p for p in problems if p is not None]
    if group is not None:  # every rank refuses together (one may hold the base that differs, the rest go on)
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, problems[:1], group=group)
        problems = [p for part in everyone for p in part]
    if problems:
        raise BaseMismatchError(problems[0])
    state = _read_json(path, storage.STATE)
    rank = dist.get_rank(group) if group is not None else 0
    rng_file = f"rng_rank{rank}.json"
    if restore_rng and os.path.isfile(os.path.join(path, rng_file)):
        rng.restore_rng_state(_read_json(path, rng_file), _rng_hooks())
    return LoadedRlhfState(iteration=it, path=path, data_position=state.get("data_position", {}),
                           extra=state.get("extra", {}))
