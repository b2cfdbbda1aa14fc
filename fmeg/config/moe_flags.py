"""Megatron's mixture-of-experts flags: their parser group, the GPTConfig fields they set, and their
rules."""

from __future__ import annotations

import argparse
import ast
from typing import Any


from fmeg.config.declare import add_group, flag, group, switch
from fmeg.config.parallel_flags import compiles

# Flags that choose a kernel or an overlap, not a number: accepted with --num-experts and named as
# ignored.
IGNORED = {
    "--moe-grouped-gemm": "experts always run as grouped matmuls (torch._grouped_mm where the "
    "device takes it)",
    "--moe-permute-fusion": "fmeg fuses no kernels by hand",
    "--moe-router-fusion": "fmeg fuses no kernels by hand",
    "--moe-shared-expert-overlap": "an overlap policy",
    "--moe-use-legacy-grouped-gemm": "one grouped-matmul path",
    "--moe-enable-deepep": "DeepEP is a kernel of the flex dispatcher, which fmeg runs as alltoall",
}
IGNORED_SETTINGS: dict[str, str] = {
    "--moe-flex-dispatcher-backend": "DeepEP and HybridEP are kernels of the flex dispatcher, "
    "which fmeg runs as alltoall"
}


def layer_freq(text: str) -> int | tuple[int, ...]:
    """--moe-layer-freq: N (layers 0, N, 2N, ... are MoE) or a list pattern such as
    "([0]*3+[1]*58)", read without eval: list literals of 0/1, + and * by integers."""
    text = text.strip()
    if "[" not in text:
        return int(text)

    def value(node: ast.AST):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError("only list literals, + and * are allowed")

    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f"not a layer pattern such as '([0]*1+[1]*3)': {e}"
        ) from None
    if not isinstance(result, list) or not all(v in (0, 1) for v in result):
        raise argparse.ArgumentTypeError("a layer pattern must be a list of 0 and 1, one per layer")
    return tuple(result)


@group("mixture of experts")
class MoEFlags:
    """Experts, their router, dispatch, balance losses and capacity."""

    ACCEPTED = {
        **{
            f: dict(action="store_true", help=f"accepted, ignored: {why}")
            for f, why in IGNORED.items()
        },
        **{
            f: dict(default=None, help=f"accepted, ignored: {why}")
            for f, why in IGNORED_SETTINGS.items()
        },
    }

    num_experts: int | None = flag(
        "--num-experts", type=int, help="experts per MoE layer (None: dense MLPs)"
    )
    expert_model_parallel_size: int = flag(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="expert parallelism: data-parallel ranks that split the experts between them",
    )
    expert_tensor_parallel_size: int | None = flag(
        "--expert-tensor-parallel-size",
        type=int,
        help="the experts' tensor parallelism: 1 or --tensor-model-parallel-size (the default)",
    )
    moe_ffn_hidden_size: int | None = flag(
        "--moe-ffn-hidden-size", type=int, help="each expert's FFN size (default --ffn-hidden-size)"
    )
    moe_layer_freq: Any = flag(
        "--moe-layer-freq", type=layer_freq, default=1, help="N, or a 0/1 pattern per layer"
    )
    moe_router_topk: int = flag(
        "--moe-router-topk", type=int, default=2, help="experts each token is routed to"
    )
    moe_router_score_function: str = flag(
        "--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax"
    )
    moe_router_pre_softmax: bool = switch(
        "--moe-router-pre-softmax",
        help="softmax over all experts before taking the top k (else over the k chosen)",
    )
    moe_router_topk_scaling_factor: float | None = flag(
        "--moe-router-topk-scaling-factor", type=float, help="multiply the routing weights by this"
    )
    moe_router_num_groups: int | None = flag(
        "--moe-router-num-groups",
        type=int,
        help="group-limited routing: the experts' groups (DeepSeek-V3's n_group)",
    )
    moe_router_group_topk: int | None = flag(
        "--moe-router-group-topk",
        type=int,
        help="group-limited routing: the groups a token may choose from",
    )
    moe_router_dtype: str | None = flag("--moe-router-dtype", choices=["fp32", "fp64"])
    moe_router_group_score_topk: int | None = flag(
        "--moe-router-group-score-topk", type=int, help=argparse.SUPPRESS
    )
    moe_router_norm_topk: Any = flag(
        "--moe-router-norm-topk",
        type=lambda t: t.lower() == "true",
        default=True,
        help=argparse.SUPPRESS,
    )
    moe_router_load_balancing_type: list[str] = flag(
        "--moe-router-load-balancing-type",
        nargs="+",
        default=["aux_loss"],
        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
    )
    moe_aux_loss_coeff: list[float] = flag(
        "--moe-aux-loss-coeff",
        type=float,
        nargs="+",
        default=[0.0],
        help="the load-balancing loss's coefficient (one per layer kind, as in Megatron)",
    )
    moe_z_loss_coeff: float | None = flag(
        "--moe-z-loss-coeff", type=float, help="the router z-loss's coefficient"
    )
    moe_expert_capacity_factor: float | None = flag(
        "--moe-expert-capacity-factor",
        type=float,
        help="tokens an expert takes, as a multiple of the even share; the rest are dropped",
    )
    moe_token_drop_policy: str = flag(
        "--moe-token-drop-policy", choices=["probs", "position"], default="probs"
    )
    moe_pad_expert_input_to_capacity: bool = switch(
        "--moe-pad-expert-input-to-capacity", help="pad each expert's tokens to its capacity"
    )
    moe_shared_expert_intermediate_size: int | None = flag(
        "--moe-shared-expert-intermediate-size",
        type=int,
        help="the hidden width of the shared experts every token goes through",
    )
    moe_shared_expert_gate: bool = switch(
        "--moe-shared-expert-gate", help="a sigmoid gate on the shared experts' output"
    )
    moe_router_enable_expert_bias: bool = switch(
        "--moe-router-enable-expert-bias",
        help="aux-loss-free balancing: a per-expert bias on the scores, updated after each step",
    )
    moe_router_bias_update_rate: float = flag(
        "--moe-router-bias-update-rate",
        type=float,
        default=1e-3,
        help="the expert bias's step per iteration",
    )
    moe_token_dispatcher_type: str = flag(
        "--moe-token-dispatcher-type",
        choices=["allgather", "alltoall", "flex"],
        default="allgather",
        help="how tokens reach their experts' ranks: all-gather / reduce-scatter, or uneven "
        "all-to-all",
    )
    moe_input_jitter_eps: float | None = flag(
        "--moe-input-jitter-eps",
        type=float,
        help="multiplicative noise on the router's input in training",
    )
    moe_per_layer_logging: bool = switch(
        "--moe-per-layer-logging",
        help="also write each MoE layer's balance losses (NAME_layer_I) to metrics.jsonl, "
        "TensorBoard and W&B (the log line keeps their means)",
    )
    moe_router_force_load_balancing: bool = switch(
        "--moe-router-force-load-balancing",
        help="for benchmarking: random router logits (still trained through), so experts get even "
        "loads",
    )


def leniencies(a: argparse.Namespace) -> list[str]:
    """The MoE flags fmeg adjusts and goes on with (in place), one warning line each."""
    if a.num_experts is None:
        return []
    out = []
    if a.moe_token_dispatcher_type == "flex":
        a.moe_token_dispatcher_type, a.flex_dispatcher = "alltoall", True
        out.append(
            "--moe-token-dispatcher-type flex runs as alltoall: the same tokens reach the same "
            "experts and the numbers are the same; DeepEP's and HybridEP's fused kernels are not "
            "in fmeg"
        )
    if a.moe_router_pre_softmax and a.moe_router_score_function == "sigmoid":
        # megatron-core's sigmoid routing never reads it
        a.moe_router_pre_softmax = False
        out.append(
            "--moe-router-pre-softmax has no effect with --moe-router-score-function sigmoid (as "
            "in megatron-core)"
        )
    return out


def model_fields(a: argparse.Namespace) -> dict:
    """The GPTConfig fields of the MoE flags (none without --num-experts)."""
    if a.num_experts is None:
        return {}
    return dict(
        num_experts=a.num_experts,
        moe_ffn_hidden_size=a.moe_ffn_hidden_size,
        moe_layer_freq=a.moe_layer_freq,
        moe_router_topk=a.moe_router_topk,
        moe_router_score_function=a.moe_router_score_function,
        moe_router_pre_softmax=a.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=a.moe_router_topk_scaling_factor,
        moe_router_num_groups=a.moe_router_num_groups,
        moe_router_group_topk=a.moe_router_group_topk,
        moe_router_group_score_topk=a.moe_router_group_score_topk,
        moe_router_norm_topk=a.moe_router_norm_topk,
        moe_router_dtype=a.moe_router_dtype,
        moe_router_load_balancing_type=a.moe_router_load_balancing_type[0],
        moe_aux_loss_coeff=a.moe_aux_loss_coeff[0],
        moe_z_loss_coeff=a.moe_z_loss_coeff,
        moe_expert_capacity_factor=a.moe_expert_capacity_factor,
        moe_token_drop_policy=a.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=a.moe_pad_expert_input_to_capacity,
        moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=a.moe_shared_expert_gate,
        moe_router_enable_expert_bias=a.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=a.moe_router_bias_update_rate,
        # megatron-core's router has one with --add-bias-linear; an older fmeg checkpoint's router
        # has none
        moe_router_bias=not a.disable_bias_linear and not getattr(a, "router_without_bias", False),
        moe_token_dispatcher_type=a.moe_token_dispatcher_type,
        moe_router_force_load_balancing=a.moe_router_force_load_balancing,
    )


def problems(a: argparse.Namespace) -> list[str]:
    """One line for each MoE flag that cannot run (Megatron's argument rules, and what fmeg lacks
    yet)."""
    out = []
    ep, etp, tp = (
        a.expert_model_parallel_size,
        a.expert_tensor_parallel_size,
        a.tensor_model_parallel_size,
    )
    if ep < 1:
        out.append(f"--expert-model-parallel-size must be positive, got {ep}")
    if etp is not None and etp not in (1, tp):
        out.append(
            f"--expert-tensor-parallel-size {etp}: fmeg splits experts over 1 or "
            f"--tensor-model-parallel-size {tp} ranks yet; use one of them"
        )
    if a.num_experts is None:
        given = [
            f for f in ("moe_router_enable_expert_bias", "moe_shared_expert_gate") if getattr(a, f)
        ]
        out += [f"--{f.replace('_', '-')} needs --num-experts" for f in given]
        if ep > 1:
            out.append(f"--expert-model-parallel-size {ep} needs --num-experts")
        return out
    if ep > 1:
        if a.num_experts % ep:
            out.append(
                f"--num-experts {a.num_experts} must be divisible by --expert-model-parallel-size "
                f"{ep}"
            )

    if len(a.moe_router_load_balancing_type) > 1 or len(a.moe_aux_loss_coeff) > 1:
        out.append(
            "--moe-router-load-balancing-type / --moe-aux-loss-coeff: fmeg takes one type and one "
            "coefficient yet; give one of each"
        )
    kind = a.moe_router_load_balancing_type[0]
    if kind == "sinkhorn":
        out.append(
            "--moe-router-load-balancing-type sinkhorn: not supported by fmeg yet; use aux_loss, "
            "seq_aux_loss, global_aux_loss or none"
        )
    if a.moe_token_dispatcher_type == "alltoall":
        expert_tp = tp if etp is None else etp
        if expert_tp > 1:
            given = "flex" if getattr(a, "flex_dispatcher", False) else "alltoall"
            out.append(
                f"--moe-token-dispatcher-type {given}: fmeg's all-to-all moves tokens to experts "
                f"that are not split over tp (expert tp {expert_tp}); add "
                "--expert-tensor-parallel-size 1 or use allgather"
            )
    if a.moe_input_jitter_eps:
        out.append(
            "--moe-input-jitter-eps: router input jitter is not supported by fmeg yet; drop the "
            "flag"
        )
    if a.moe_router_enable_expert_bias and a.moe_router_score_function != "sigmoid":
        out.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    if a.tensor_model_parallel_size > 1 and not a.sequence_parallel:
        out.append("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel")
    return out


def ignored(a: argparse.Namespace) -> list[str]:
    """'--flag: why' for the accepted, ignored MoE flags that were given (without --num-experts,
    every MoE flag given, as Megatron ignores them then)."""
    given = [
        (f, why)
        for f, why in {**IGNORED, **IGNORED_SETTINGS}.items()
        if getattr(a, f.lstrip("-").replace("-", "_")) not in (None, False)
    ]
    compiled = compiles(a)
    if a.num_experts is not None and a.moe_token_dispatcher_type == "alltoall" and compiled:
        given.append(
            (
                "--moe-token-dispatcher-type alltoall",
                "compiled stages (--compile, on by default with CUDA) move tokens by allgather, "
                "the same numbers: the all-to-all's split sizes are host values",
            )
        )
    if a.num_experts is None:
        defaults = vars(_defaults())
        given = [
            (f"--{k.replace('_', '-')}", "has no effect without --num-experts")
            for k, v in vars(a).items()
            if k.startswith("moe_")
            and k in defaults
            and (v != defaults[k] or k in getattr(a, "given", ()))
        ]
    return [f"{f}: {why}" for f, why in given]


def _defaults() -> argparse.Namespace:
    """Every MoE flag's default, the accepted ones' included."""
    parser = argparse.ArgumentParser()
    add_group(parser, MoEFlags)
    return parser.parse_args([])
