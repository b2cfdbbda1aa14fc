"""fmeg's Adam state as Megatron-LM's distributed optimizer saves it fully reshardable, for
export-megatron: each parameter's exp_avg, exp_avg_sq and fp32 master ("param") as a tensor of the
parameter's global shape under "optimizer.state.<name>.<its model key>", and in common.pt the
optimizer's param groups (carrying the step), the LR scheduler's state and the content metadata
that tell Megatron-LM's load which layout the state has.

    tensors = state_tensors({"mu": mu, "nu": nu, "main": main}, config, padded_vocab)
    common = common_state(step, arguments, consumed_samples)
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from fmeg.interop.megatron.export import megatron_tensors
from fmeg.models import gpt

# fmeg's kinds -> the name of Megatron's per-parameter state
NAMES = {"mu": "exp_avg", "nu": "exp_avg_sq", "main": "param"}
# what Megatron-LM's save records of the checkpoint's content (its
# _build_sharded_state_dict_metadata for the distributed optimizer, fully reshardable)
CONTENT_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": False,
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}


def state_tensors(
    trees: dict[str, Any], config: gpt.GPTConfig, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """{kind: one-device tree} (mu, nu, main) as Megatron's keys and global tensors."""
    out = {}
    for kind, values in trees.items():
        for key, t in megatron_tensors(values, config, padded_vocab).items():
            out[f"optimizer.state.{NAMES[kind]}.{key}"] = t
    return out


def param_groups(step: int, a: dict) -> list[dict]:
    """Megatron's param groups, one per (decays?, decoupled lr?, experts?) as its optimizer
    builds them; its load matches them by those and takes the step and hyperparameters."""
    lr = a.get("lr", 0.0)
    groups = []
    for decays, decoupled, experts in itertools.product((True, False), repeat=3):
        groups.append(
            {
                "params": [],
                "lr": lr,
                "max_lr": a.get("decoupled_lr") or lr if decoupled else lr,
                "min_lr": a.get("min_lr", 0.0),
                "betas": (a.get("adam_beta1", 0.9), a.get("adam_beta2", 0.999)),
                "eps": a.get("adam_eps", 1e-8),
                "weight_decay": a.get("weight_decay", 0.01),
                "amsgrad": False,
                "maximize": False,
                "foreach": None,
                "capturable": False,
                "differentiable": False,
                "fused": None,
                "decoupled_weight_decay": True,
                "wd_mult": 1.0 if decays else 0.0,
                "lr_mult": 1.0,
                "is_expert_parallel": experts,
                "is_decoupled_lr": decoupled,
                "default_config": True,
                "step": float(step),
            }
        )
    return groups


def scheduler_state(a: dict, consumed_samples: int) -> dict:
    """OptimizerParamScheduler.state_dict() of Megatron-LM for these run arguments, its steps
    counted in samples as Megatron's are."""
    batch = a.get("global_batch_size") or 1
    iters = a.get("train_iters") or 0
    decay = a.get("lr_decay_samples") or (a.get("lr_decay_iters") or iters) * batch
    warmup = a.get("lr_warmup_samples") or (a.get("lr_warmup_iters") or 0) * batch
    if a.get("lr_warmup_fraction") is not None:
        warmup = int(a["lr_warmup_fraction"] * decay)
    wd = a.get("weight_decay", 0.01)
    return {
        "max_lr": a.get("lr"),
        "lr_warmup_steps": warmup,
        "num_steps": consumed_samples,
        "lr_decay_style": a.get("lr_decay_style", "linear"),
        "lr_decay_steps": decay,
        "min_lr": a.get("min_lr", 0.0),
        "start_wd": a.get("start_weight_decay") if a.get("start_weight_decay") is not None else wd,
        "end_wd": a.get("end_weight_decay") if a.get("end_weight_decay") is not None else wd,
        "wd_incr_style": a.get("weight_decay_incr_style", "constant"),
        "wd_incr_steps": (a.get("train_samples") or iters * batch),
    }


def common_state(step: int, arguments: dict, consumed_samples: int) -> dict:
    """What common.pt holds of the optimizer beside the args and the iteration."""
    return {
        "optimizer": {
            "optimizer": {"param_groups": param_groups(step, arguments)},
            "param_state_sharding_type": "fully_reshardable",
        },
        "opt_param_scheduler": scheduler_state(arguments, consumed_samples),
        "content_metadata": dict(CONTENT_METADATA),
    }
