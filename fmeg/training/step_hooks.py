"""The step's hooks: the bookkeeping a model variant needs around the one training step, kept out
of it (TorchTitan registers the MoE bias update as an optimizer hook).

    hooks = step_hooks(config, layout, mesh, loss_scale=1.0, per_token=False)
    microbatches = prepare(hooks, microbatches)      # each hook's buffers joined to the
    microbatches ... forward, backward, optimizer step ...
    for hook in hooks: hook.after_step(state)        # the experts' bias update
    values = metrics(hooks, per_layer)               # the auxiliary losses as Megatron logs them

MoEHook: the balance losses' backward seeds and value buffers, the tokens each expert took and
Megatron's aux-loss-free bias update after the step. MTPHook: the multi-token prediction depths'
losses.
"""

from __future__ import annotations

from typing import Any

import torch

from fmeg.models import gpt, moe
from fmeg.models import gpt_pipeline as gp
from fmeg.parallel.layout import Layout
from fmeg.parallel.mesh import Mesh


class MoEHook:
    """The experts' bookkeeping around a step."""

    def __init__(
        self, config: gpt.GPTConfig, layout: Layout, mesh: Mesh, loss_scale: float, per_token: bool
    ):
        self.config, self.layout, self.mesh = config, layout, mesh
        self.loss_scale, self.per_token = loss_scale, per_token
        self.metrics: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def prepare(self, microbatches: list[dict]) -> list[dict]:
        microbatches, (self.metrics, self.counts) = with_aux_losses(
            microbatches,
            self.config,
            self.loss_scale,
            self.per_token,
            self.layout.cp,
            self.mesh.group("cp"),
        )
        return microbatches

    def after_step(self, state: Any) -> None:
        if self.counts is not None:
            update_expert_bias(state, self.counts, self.config, self.layout, self.mesh)

    def values(self, per_layer: dict) -> dict:
        return aux_loss_values(self.metrics, self.config, self.layout, self.mesh, per_layer)


class MTPHook:
    """The multi-token prediction depths' losses, written by the last stage."""

    def __init__(self, config: gpt.GPTConfig, layout: Layout, mesh: Mesh):
        self.config, self.layout, self.mesh = config, layout, mesh
        self.metrics: torch.Tensor | None = None

    def prepare(self, microbatches: list[dict]) -> list[dict]:
        microbatches, self.metrics = with_mtp_metrics(microbatches, self.config)
        return microbatches

    def after_step(self, state: Any) -> None:
        pass

    def values(self, per_layer: dict) -> dict:
        return mtp_loss_values(self.metrics, self.layout, self.mesh)


def step_hooks(
    config: gpt.GPTConfig, layout: Layout, mesh: Mesh, *, loss_scale: float, per_token: bool
) -> list:
    """The hooks the model's variants need: the experts', multi-token prediction's."""
    hooks: list = []
    if config.experts:
        hooks.append(MoEHook(config, layout, mesh, loss_scale, per_token))
    if config.mtp_depth:
        hooks.append(MTPHook(config, layout, mesh))
    return hooks


def prepare(hooks: list, microbatches: list[dict]) -> list[dict]:
    """The microbatches (copies) with every hook's buffers."""
    for hook in hooks:
        microbatches = hook.prepare(microbatches)
    return microbatches


def metrics(hooks: list, per_layer: dict) -> dict:
    """{Megatron's name: device tensor} of every hook's logged values; per_layer receives the
    per-layer ones."""
    out: dict = {}
    for hook in hooks:
        out |= hook.values(per_layer)
    return out


def with_aux_losses(
    microbatches: list[dict],
    config: gpt.GPTConfig,
    loss_scale: float,
    per_token: bool,
    cp: int = 1,
    cp_group: Any = None,
) -> tuple[list[dict], tuple[torch.Tensor, torch.Tensor | None]]:
    """For a mixture of experts, the microbatches (copies) with what their auxiliary losses need:
    loss_seed, the backward seed of their sum (loss scale / microbatches; with per-token losses,
    loss scale times the number of the microbatch's tokens, loss-masked or not, as megatron-core's
    router scales them: each of the cp ranks holding 1/cp of them seeds its part of the balance
    losses with the whole microbatch's count, so the curve is one rank's; with a padding_mask, its
    unpadded tokens, summed over cp_group, as megatron-core's router counts them), and moe_metrics,
    this microbatch's row of a [microbatches, layers, len(moe.METRICS)] buffer (returned) the layers
    write their values into, and with the expert bias moe_counts, its row of a [microbatches,
    layers, experts] buffer of tokens per expert (layers: the decoder's, then the multi-token
    prediction layers')."""
    device, layers = microbatches[0]["tokens"].device, len(moe.moe_layers(config, mtp=True))
    metrics = torch.zeros(len(microbatches), layers, len(moe.METRICS), device=device)
    counts = (
        torch.zeros(len(microbatches), layers, config.experts.num_experts, device=device)
        if config.experts.router.enable_expert_bias
        else None
    )
    m = len(microbatches)
    global_counts = (
        torch.zeros(m, layers, config.experts.num_experts, device=device)
        if config.experts.router.load_balancing_type == "global_aux_loss"
        else None
    )
    out = []
    for i, mb in enumerate(microbatches):
        # per-token: megatron-core's router scales its aux losses by the tokens it routed, all of
        # the microbatch's (the loss mask does not enter), which the division by the global batch's
        # loss tokens then cancels
        seed = torch.tensor(
            loss_scale * (mb["tokens"].numel() * cp if per_token else 1.0 / len(microbatches)),
            device=device,
        )
        if per_token and mb.get("padding_mask") is not None:
            unpadded = (~mb["padding_mask"].bool()).sum().to(device=device, dtype=seed.dtype)
            seed = loss_scale * (
                cp_group.all_reduce(unpadded) if cp_group is not None else unpadded
            )
        step = {}
        # microbatch i writes row i and averages rows 0..i
        if global_counts is not None:
            order = torch.arange(m, device=device)
            step = {
                "moe_global_counts": global_counts,
                "moe_one_hot": (order == i).float(),
                "moe_seen": (order <= i).float(),
            }
        out.append(
            {
                **mb,
                "loss_seed": seed,
                "moe_metrics": metrics[i],
                **({"moe_counts": counts[i]} if counts is not None else {}),
                **step,
            }
        )
    return out, (metrics, counts)


def update_expert_bias(
    state: Any, counts: torch.Tensor, config: gpt.GPTConfig, layout: Layout, mesh: Mesh
) -> None:
    """Megatron's aux-loss-free balancing after a step: each MoE layer's expert_bias += rate *
    sign(mean load - load), the loads being the tokens each expert received over the step's
    microbatches and every rank."""
    total = counts.sum(dim=0)
    for name in ("tp_dp_cp", "pp"):
        group = mesh.group(name)
        total = group.all_reduce(total) if group is not None else total
    delta = config.experts.router.bias_update_rate * torch.sign(
        total.mean(dim=-1, keepdim=True) - total
    )
    kinds = moe.moe_layers(config, mtp=True)
    for stage in state.params:
        for j, index in enumerate(gp.stage_layers(config, stage, layout.stages)):
            if kinds[index]:
                state.add_(f"{stage}.layers.{j}.mlp.router.expert_bias", delta[index])
        # the multi-token prediction layers'
        if stage == layout.num_stages - 1:
            for k in range(config.mtp_depth):
                if kinds[config.num_layers + k]:
                    state.add_(
                        f"{stage}.mtp.{k}.layer.mlp.router.expert_bias",
                        delta[config.num_layers + k],
                    )


def aux_loss_values(
    metrics: torch.Tensor | None,
    config: gpt.GPTConfig,
    layout: Layout,
    mesh: Mesh,
    per_layer_out: dict | None = None,
) -> dict:
    """{Megatron's name: device tensor} of the auxiliary losses in use, as Megatron logs them: each
    layer's value averaged over microbatches and data parallelism, then over the MoE layers, the
    multi-token prediction layers' included (parts under sequence parallelism and the layers of
    other pipeline stages summed over the tp-pp group first). per_layer_out, when given, receives
    each MoE layer's value as megatron-core's --moe-per-layer-logging names it
    ("load_balancing_loss_layer_3", layers counted from 0 as in its tracker)."""
    if metrics is None:
        return {}
    per_layer = metrics.mean(dim=0)
    # parts over tp (sp) and cp sum to a microbatch's value
    for name in ("mp", "dp", "cp"):
        group = mesh.group(name)
        if group is not None:
            per_layer = group.all_reduce(per_layer)
    kind = config.experts.router.load_balancing_type
    used = {
        "load_balancing_loss": config.experts.aux_loss_coeff > 0
        and kind in ("aux_loss", "seq_aux_loss"),
        "z_loss": bool(config.experts.z_loss_coeff),
        "global_load_balancing_loss": config.experts.aux_loss_coeff > 0
        and kind == "global_aux_loss",
    }
    # the global loss's parts sum over every data rank to the batch's loss; the others are
    # data-parallel means
    per_layer = (
        per_layer * torch.tensor([1.0 / layout.dp, 1.0 / layout.dp, 1.0], device=per_layer.device)
        if used["global_load_balancing_loss"]
        else per_layer / layout.dp
    )
    # megatron-core's name for the sequence-level loss
    if kind == "seq_aux_loss":
        used = {
            ("seq_load_balancing_loss" if k == "load_balancing_loss" else k): v
            for k, v in used.items()
        }
    moe_indices = [i for i, is_moe in enumerate(moe.moe_layers(config, mtp=True)) if is_moe]
    mean = per_layer[moe_indices].mean(dim=0)
    if per_layer_out is not None:
        per_layer_out |= {
            f"{name}_layer_{index}": per_layer[index, i]
            for index in moe_indices
            for i, name in enumerate(used)
            if used[name]
        }
    return {name: mean[i] for i, name in enumerate(used) if used[name]}


def with_mtp_metrics(
    microbatches: list[dict], config: gpt.GPTConfig
) -> tuple[list[dict], torch.Tensor | None]:
    """For multi-token prediction layers, the microbatches (copies) with mtp_metrics, their row of a
    [microbatches, depths] buffer (returned) the last stage writes each depth's loss into
    (fmeg.models.mtp)."""
    if not config.mtp_depth:
        return microbatches, None
    metrics = torch.zeros(
        len(microbatches), config.mtp_depth, device=microbatches[0]["tokens"].device
    )
    return [{**mb, "mtp_metrics": metrics[i]} for i, mb in enumerate(microbatches)], metrics


def mtp_loss_values(metrics: torch.Tensor | None, layout: Layout, mesh: Mesh) -> dict:
    """{"mtp_1 loss": device tensor, ...}: each depth's loss as megatron-core logs it, averaged over
    microbatches and data parallelism (each cp rank holds its share; other pipeline stages hold
    zeros)."""
    if metrics is None:
        return {}
    per_depth = metrics.mean(dim=0)
    for name in ("cp", "dp", "pp"):
        group = mesh.group(name)
        if group is not None:
            per_depth = group.all_reduce(per_depth)
    per_depth = per_depth / layout.dp
    return {f"mtp_{k + 1} loss": per_depth[k] for k in range(per_depth.shape[0])}
