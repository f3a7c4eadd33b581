"""Mixture-of-experts models in training: routing replay, the routing agreement, and the auxiliary losses.

megatron-core's MoE layer (``TopKRouter`` + experts, built by rlhf.models.gpt) routes each token to the top k
of its experts. Three things sit around it here, each per model (a process holds several models, so nothing
goes through megatron's process-wide lists):

* **Routing replay** (``--routing-replay``, verl's R3, slime's): a forward run inside :func:`replayed` uses
  the experts the engine chose for each token (``routing`` [b, T, L, k], global MoE layer L, -1 where the
  engine computed nothing: a sample's last token and the padding, which take the router's own choice); the
  router's probabilities are still computed, and trained, at those experts. Each router's
  ``router_replay`` is a :class:`Replay` (megatron's ``RouterReplay`` hook in its top-k).
* **Routing agreement**: in every forward of :func:`replayed`, whether replaying or not, the fraction of
  (token, layer) choices where the router's own top-k set equals the engine's, over the tokens the engine
  computed (:func:`routing_agreement` reads it).
* **Auxiliary losses**: megatron adds the load-balancing loss and the z-loss to the backward through
  ``MoEAuxLossAutoScaler``, whose gradient scale is one process-wide value that megatron's own schedule sets
  to 1 / micro-batches. Our executor sets it before each backward with :func:`set_aux_loss_scale`, so that a
  step's auxiliary loss is the token-weighted mean over its micro-batches on every replica (the weighting of
  the main loss), times the fp16 loss scale; :class:`AuxLosses` keeps each forward's values for the logs.
"""

from __future__ import annotations

import contextlib

import torch

AUX_LOSS_NAMES = ("load_balancing_loss", "z_loss")
"""The auxiliary losses a MoE model logs (each already times its coefficient, summed over the layers)."""


def routers(model: torch.nn.Module) -> list:
    """(global MoE layer, router) of this pipeline stage's MoE layers, in layer order."""
    return [(layer.layer_number - 1, layer.mlp.router) for layer in model.decoder.layers
            if hasattr(layer.mlp, "router")]


class Replay:
    """One router's replay targets and agreement counts, in megatron's ``RouterReplay`` role: its top-k
    calls :meth:`get_replay_topk` with the scores (softmax of the logits, or the logits themselves with
    megatron's pre-softmax off) and its own top-k function."""

    def __init__(self):
        self.targets: torch.Tensor | None = None  # [tokens, k] in the router's token order; -1: its own choice
        self.replay = False
        self.agree = self.counted = 0  # device tensors once counted (no host sync per forward)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.targets is None:
            return probs, own
        targets = self.targets.to(device=own.device, dtype=own.dtype)
        computed = (targets >= 0).all(dim=1)
        same = (own.sort(dim=1).values == targets.sort(dim=1).values).all(dim=1)
        self.agree = self.agree + (same & computed).sum()
        self.counted = self.counted + computed.sum()
        if not self.replay:
            return probs, own
        chosen = torch.where(computed.unsqueeze(1), targets, own)
        return scores.gather(1, chosen), chosen


def attach(model: torch.nn.Module) -> None:
    """Give every router of ``model`` a :class:`Replay` and an :class:`AuxLosses` record (build_model calls it
    for MoE models)."""
    for _, router in routers(model):
        router.router_replay = Replay()
        router.aux_losses = AuxLosses(router)


def _router_order(routing: torch.Tensor, packed) -> torch.Tensor:
    """[b, T, L, k] per sample and position -> [tokens, L, k] in the order the router sees the micro-batch's
    tokens: megatron's [s, b] flattened (position-major) padded, the packed row's order packed."""
    b, t = routing.shape[:2]
    flat = routing.reshape(b * t, *routing.shape[2:])
    if packed is not None:
        return flat[packed.index]
    return routing.transpose(0, 1).reshape(b * t, *routing.shape[2:])


@contextlib.contextmanager
def replayed(model: torch.nn.Module, routing: torch.Tensor | None, replay: bool, packed=None):
    """A forward of ``model`` (this stage) inside: each MoE layer compares its own top-k with ``routing``
    ([b, T, L, k], the engine's experts; None: nothing to compare) and, with ``replay``, uses it."""
    if routing is None:
        yield model
        return
    order = _router_order(routing, packed)
    pairs = routers(model)
    for layer, router in pairs:
        router.router_replay.targets, router.router_replay.replay = order[:, layer], replay
    try:
        yield model
    finally:
        for _, router in pairs:
            router.router_replay.targets = None


def routing_agreement(model: torch.nn.Module) -> tuple:
    """(agreeing, counted) (token, layer) choices of this stage since the last call (ints or 0-dim device
    tensors), and reset them."""
    agree = counted = 0
    for _, router in routers(model):
        agree, counted = agree + router.router_replay.agree, counted + router.router_replay.counted
        router.router_replay.agree = router.router_replay.counted = 0
    return agree, counted


def set_aux_loss_scale(scale: torch.Tensor) -> None:
    """The gradient scale of the auxiliary losses of the next backward (megatron's one process-wide value)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(scale)


class AuxLosses:
    """The auxiliary losses one router added in training forwards since the last :meth:`take` (detached,
    each times its coefficient): megatron's router computes them and hands them to
    ``attach_and_log_load_balancing_loss`` and ``z_loss_func``; this record wraps both on this router."""

    def __init__(self, router):
        from megatron.core.transformer.moe import router as router_module

        self.values = dict.fromkeys(AUX_LOSS_NAMES, 0.0)
        attach_original = router.attach_and_log_load_balancing_loss
        z_loss_original = router_module.z_loss_func

        def attach_and_log(activation, aux_loss_coeff, aux_loss, aux_loss_name, *args, **kwargs):
            self.add("load_balancing_loss", aux_loss)
            return attach_original(activation, aux_loss_coeff, aux_loss, aux_loss_name, *args, **kwargs)

        def apply_z_loss(logits, padding_mask=None):
            if router.config.moe_z_loss_coeff is not None and router.training and torch.is_grad_enabled():
                coeff = router.config.moe_z_loss_coeff / router.tp_cp_group.size()
                self.add("z_loss", z_loss_original(logits.detach(), coeff, padding_mask=padding_mask))
            return type(router).apply_z_loss(router, logits, padding_mask=padding_mask)

        router.attach_and_log_load_balancing_loss = attach_and_log
        router.apply_z_loss = apply_z_loss

    def add(self, name: str, value: torch.Tensor) -> None:
        self.values[name] = self.values[name] + value.detach().float()

    def take(self) -> dict:
        """The sums since the last call (floats or 0-dim device tensors), reset."""
        out = self.values
        self.values = dict.fromkeys(AUX_LOSS_NAMES, 0.0)
        return out


def aux_losses(model: torch.nn.Module) -> dict:
    """This stage's auxiliary losses since the last call, summed over its MoE layers, and reset them."""
    out = dict.fromkeys(AUX_LOSS_NAMES, 0.0)
    for _, router in routers(model):
        for name, value in router.aux_losses.take().items():
            out[name] = out[name] + value
    return out
