"""Megatron's fully-sharded data-parallel flags: their parser group, the sharding they set, and
their rules.

--use-megatron-fsdp takes --data-parallel-sharding-strategy (Megatron reads the strategy only then);
--use-torch-fsdp2 is torch's fully_shard, which keeps a slice of everything: optim_grads_params.
Without either, --use-distributed-optimizer is ZeRO-1 (optim). The sharding is fmeg.state.flat's.
"""

from __future__ import annotations

import argparse

from fmeg.config.declare import flag, group, switch

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
_BUFFERS = (
    "a buffer policy: each unit's gather buffer is allocated once and its storage released after "
    "use"
)
# Megatron-FSDP flags that choose kernels or buffers: {flag: (argparse keywords, why ignored)}
IGNORED = {
    "--fsdp-double-buffer": ({"action": "store_true"}, _BUFFERS),
    "--use-nccl-ub": (
        {"action": "store_true"},
        "NCCL user buffers are a kernel choice fmeg does not make",
    ),
    "--megatron-fsdp-main-params-dtype": (
        {"default": None},
        "the master weights are fp32, as this flag's default",
    ),
    "--megatron-fsdp-main-grads-dtype": (
        {"default": None},
        "gradients accumulate in fp32, or in bf16 with --grad-reduce-in-bf16",
    ),
    "--megatron-fsdp-grad-comm-dtype": (
        {"default": None},
        "gradients are reduced in the dtype they accumulate in (--grad-reduce-in-bf16)",
    ),
    "--init-model-with-meta-device": (
        {"action": "store_true"},
        "what fmeg always does: each rank draws its own layers one at a time and keeps its shard "
        "of each",
    ),
}


@group("fully sharded data parallelism")
class FSDPFlags:
    """Megatron-FSDP's sharding strategy and what it keeps gathered."""

    ACCEPTED = {f: dict(**kw, help=argparse.SUPPRESS) for f, (kw, _) in IGNORED.items()}

    use_megatron_fsdp: bool = switch(
        "--use-megatron-fsdp",
        help="shard over data-parallel ranks as --data-parallel-sharding-strategy says",
    )
    use_torch_fsdp2: bool = switch(
        "--use-torch-fsdp2",
        help="torch's fully_shard: weights, gradients and optimizer state sharded "
        "(optim_grads_params)",
    )
    data_parallel_sharding_strategy: str = flag(
        "--data-parallel-sharding-strategy",
        default="no_shard",
        choices=STRATEGIES,
        help="with --use-megatron-fsdp, what each data-parallel rank keeps a slice of: nothing, "
        "the optimizer state (ZeRO-1), also the gradients, also the weights (gathered layer by "
        "layer)",
    )
    outer_dp_sharding_strategy: str = flag(
        "--outer-dp-sharding-strategy",
        default="no_shard",
        choices=["no_shard", "optim"],
        help="hybrid sharding's outer level: no_shard only",
    )
    num_distributed_optimizer_instances: int = flag(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="hybrid sharding: the sharded state's replicas; each shards it over dp x cp / N ranks "
        "and gradients are summed over the N replicas after",
    )
    torch_fsdp2_reshard_after_forward: str = flag(
        "--torch-fsdp2-reshard-after-forward",
        default="auto",
        help="with --use-torch-fsdp2: true frees each layer's gathered weights after its forward "
        "(gathered again for backward), false keeps them until backward, auto keeps the embedding "
        "and the output layer only (torch's default)",
    )
    torch_fsdp2_no_reshard_after_forward: bool = switch(
        "--torch-fsdp2-no-reshard-after-forward", help="--torch-fsdp2-reshard-after-forward false"
    )


def reshard_after_forward(a: argparse.Namespace) -> str:
    """true | false | auto: which gathered units are freed after their forward (fmeg.state.flat)."""
    if not a.use_torch_fsdp2:
        # Megatron-FSDP frees every unit after its forward
        return "true"
    return (
        "false"
        if a.torch_fsdp2_no_reshard_after_forward
        else a.torch_fsdp2_reshard_after_forward.lower()
    )


def sharding(a: argparse.Namespace) -> str:
    """What each data-parallel rank keeps a slice of, from the flags."""
    if a.use_torch_fsdp2:
        return "optim_grads_params"
    if a.use_megatron_fsdp and a.data_parallel_sharding_strategy != "no_shard":
        return a.data_parallel_sharding_strategy
    # dist_muon: Megatron's deprecated name for muon with the distributed optimizer
    return "optim" if a.use_distributed_optimizer or a.optimizer == "dist_muon" else "no_shard"


def ignored(a: argparse.Namespace) -> list[str]:
    """'--flag: why' for the FSDP flags given to no effect."""
    out = [
        f"{flag}: {why}"
        for flag, (_, why) in IGNORED.items()
        if getattr(a, flag.lstrip("-").replace("-", "_")) not in (None, False)
    ]
    strategy = a.data_parallel_sharding_strategy
    if strategy != "no_shard" and not a.use_megatron_fsdp:
        out.append(
            f"--data-parallel-sharding-strategy {strategy}: "
            + (
                "--use-torch-fsdp2 shards everything (optim_grads_params)"
                if a.use_torch_fsdp2
                else "has no effect without --use-megatron-fsdp (as in Megatron)"
            )
        )
    if not a.use_torch_fsdp2 and (
        a.torch_fsdp2_no_reshard_after_forward
        or a.torch_fsdp2_reshard_after_forward.lower() != "auto"
    ):
        out.append(
            "--torch-fsdp2-reshard-after-forward: has no effect without --use-torch-fsdp2 (as in "
            "Megatron)"
        )
    return out


def problems(a: argparse.Namespace) -> list[str]:
    """One line for each FSDP flag that cannot run."""
    out = []
    if a.use_megatron_fsdp and a.use_torch_fsdp2:
        out.append(
            "--use-megatron-fsdp and --use-torch-fsdp2 are two implementations of one thing; give "
            "one"
        )
    if a.outer_dp_sharding_strategy != "no_shard":
        out.append(
            f"--outer-dp-sharding-strategy {a.outer_dp_sharding_strategy}: hybrid sharding is not "
            "supported by fmeg yet; use no_shard or drop the flag"
        )
    value = a.torch_fsdp2_reshard_after_forward
    if value.lower() not in ("auto", "true", "false"):
        out.append(
            f"--torch-fsdp2-reshard-after-forward {value}: "
            + (
                "resharding to a smaller group after forward is not supported by fmeg yet; use "
                "true, false or auto"
                if value.isdigit()
                else "expected auto, true, false or a number of ranks"
            )
        )
    n = a.num_distributed_optimizer_instances
    if n < 1:
        out.append(f"--num-distributed-optimizer-instances must be positive, got {n}")
    elif n > 1 and sharding(a) == "no_shard":
        out.append(
            f"--num-distributed-optimizer-instances {n}: replicas of a sharded state need one: "
            "add --use-distributed-optimizer (or Megatron-FSDP's sharding)"
        )
    return out
