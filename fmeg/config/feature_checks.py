"""The flags of features checked together: the precision-aware optimizer's dtypes, flags that need
another, recomputation, and the experts' flags against the layout."""

from __future__ import annotations

import argparse


from fmeg.config import moe_flags
from fmeg.config.declare import flags_of
from fmeg.config.optimizer_flags import OptimizerChoiceFlags


def optimizer_precision_problems(a: argparse.Namespace) -> list[str]:
    """Megatron's precision-aware optimizer flags: the dtypes act with
    --use-precision-aware-optimizer only, and fmeg stores the moments in fp32 or bf16 (fp16 and fp8
    moments need Megatron's per-tensor scaling) with fp32 main weights and gradients."""
    given = {
        flag: getattr(a, flag)
        for flag in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        if getattr(a, flag) != "fp32"
    }
    if given and not a.use_precision_aware_optimizer:
        flag, value = next(iter(given.items()))
        return [
            f"--{flag.replace('_', '-')} {value} acts with --use-precision-aware-optimizer (as in "
            "Megatron): add it, or drop the flag"
        ]
    out = []
    for flag in ("main_grads_dtype", "main_params_dtype"):
        if flag in given:
            out.append(
                f"--{flag.replace('_', '-')} {given[flag]}: fmeg keeps fp32 main weights and "
                "gradients (not yet narrower ones); use fp32"
                + (
                    " (--grad-reduce-in-bf16 reduces them in bf16)"
                    if flag == "main_grads_dtype"
                    else ""
                )
            )
    for flag in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if given.get(flag) in ("fp16", "fp8"):
            out.append(
                f"--{flag.replace('_', '-')} {given[flag]}: moments in fp16 or fp8 need Megatron's "
                "scaling, which fmeg does not have yet; use bf16 or fp32"
            )
    return out


# flags that only mean something beside another: {dest given: (what it needs, the flag that gives
# it)}
_NEEDS = {
    **{
        dest: ("multi_latent_attention", "--multi-latent-attention")
        for dest in (
            "q_lora_rank",
            "kv_lora_rank",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "v_head_dim",
        )
    },
    **{
        dest: ("fim_data", "--fim-data")
        for dest in (
            "fim_rate",
            "fim_spm_rate",
            "fim_split_sample",
            "fim_fragment_rate",
            "fim_no_prefix",
        )
    },
    "window_attn_skip_freq": ("window_size", "--window-size"),
}


def unused_flag_problems(a: argparse.Namespace) -> list[str]:
    """Flags given that would change nothing, one line each (a silent no-op hides a mistaken
    command)."""
    given = set(getattr(a, "given", ()))
    out = [
        f"--{dest.replace('_', '-')} applies to {flag}, which is not given: add it or drop this "
        "flag"
        for dest, (need, flag) in _NEEDS.items()
        if dest in given and not getattr(a, need)
    ]
    experts = [m for m in a.recompute_modules or () if m in ("moe", "moe_act")]
    if experts and not a.num_experts and "recompute_modules" in given:
        out.append(
            f"--recompute-modules {experts[0]} recomputes the experts, and the model has none "
            "(--num-experts): drop it"
        )
    if (
        "shared_experts" in (a.recompute_modules or ())
        and not a.moe_shared_expert_intermediate_size
    ):
        out.append(
            "--recompute-modules shared_experts recomputes the shared experts, and the model has "
            "none (--moe-shared-expert-intermediate-size): drop it"
        )
    return out


MUONS = ("muon", "dist_muon", "adaptive_muon")
# the optimizers that read each prefix's flags of OptimizerChoiceFlags (sgd_momentum, muon_*,
# lion_*, soap_*); lion_*: only Muon's --muon-scalar-optimizer lion (--optimizer lion and soap
# take --adam-beta1/2, as Megatron-LM's emerging optimizers do)
_READERS = {"sgd": ("sgd",), "muon": MUONS, "lion": MUONS, "soap": ("soap",)}


def _optimizer_flags() -> dict[str, str]:
    """{dest: flag} of the flags of the optimizers other than Adam."""
    out = {dest: f.names[0] for dest, f in flags_of(OptimizerChoiceFlags)}
    out |= {name[2:].replace("-", "_"): name for name in OptimizerChoiceFlags.ACCEPTED}
    return {dest: flag for dest, flag in out.items() if dest.split("_")[0] in _READERS}


def optimizer_flag_problems(a: argparse.Namespace) -> list[str]:
    """A flag given that only an optimizer other than --optimizer's reads, one line each naming
    the flag and the optimizer that reads it (a silent no-op hides a mistaken command). --adam-*
    are accepted under every optimizer: Megatron's scripts pass them whatever --optimizer is, and
    Adam steps the leaves Lion, SOAP and Muon leave to it."""
    given = set(getattr(a, "given", ()))
    out = []
    for dest, flag in _optimizer_flags().items():
        kind = dest.split("_")[0]
        readers = _READERS[kind]
        if dest not in given:
            continue
        if kind == "lion" and a.optimizer in ("lion", "soap"):
            beta = "--adam-beta1" if dest.endswith("1") else "--adam-beta2"
            out.append(
                f"{flag} is read by --muon-scalar-optimizer lion; --optimizer {a.optimizer} takes "
                f"its betas from --adam-beta1/2, as Megatron-LM's does: give {beta} instead"
            )
            continue
        if kind == "lion" and a.optimizer in MUONS and a.muon_scalar_optimizer != "lion":
            out.append(
                f"{flag} is read by --muon-scalar-optimizer lion, and this run's Muon steps the "
                f"other leaves with {a.muon_scalar_optimizer}: add --muon-scalar-optimizer lion "
                "or drop the flag"
            )
        elif a.optimizer not in readers:
            which = f"--optimizer {' / '.join(readers)}"
            if kind == "lion":
                which += " with --muon-scalar-optimizer lion"
            out.append(
                f"{flag} is read by {which}, and this run's --optimizer is {a.optimizer}: give "
                "that optimizer or drop the flag"
            )
    return out


def recompute_problems(a: argparse.Namespace) -> list[str]:
    """Megatron's rules for the recompute flags, one line each."""
    uneven = getattr(a, "pipeline_stage_layers", None)
    pp = a.pipeline_model_parallel_size
    # the most layers a pipeline rank holds
    per_rank = max(sum(uneven[r::pp]) for r in range(pp)) if uneven else a.num_layers // max(pp, 1)
    if a.recompute_modules is not None and a.recompute_granularity != "selective":
        return [
            "--recompute-modules applies to --recompute-granularity selective (or "
            "--recompute-activations)"
        ]
    if "mla_up_proj" in (a.recompute_modules or ()) and not a.multi_latent_attention:
        return [
            "--recompute-modules mla_up_proj recomputes multi-latent attention's up-projections: "
            "add --multi-latent-attention or drop it"
        ]
    if a.recompute_granularity is None:
        given = [
            f for f in ("recompute_method", "recompute_num_layers") if getattr(a, f) is not None
        ]
        return [f"--{f.replace('_', '-')} needs --recompute-granularity full" for f in given]
    if a.recompute_granularity == "selective":
        given = [
            f for f in ("recompute_method", "recompute_num_layers") if getattr(a, f) is not None
        ]
        return [
            f"--{f.replace('_', '-')} applies to --recompute-granularity full, not selective"
            for f in given
        ]
    if a.recompute_method is None or a.recompute_num_layers is None:
        return [
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            "--recompute-num-layers"
        ]
    low = 1 if a.recompute_method == "uniform" else 0
    if not low <= a.recompute_num_layers <= per_rank:
        return [
            f"--recompute-num-layers {a.recompute_num_layers} must be between {low} and the "
            f"{per_rank} layers of each pipeline rank with --recompute-method {a.recompute_method}"
        ]
    return []


def moe_problems(a: argparse.Namespace, tp: int) -> list[str]:
    """Megatron's mixture-of-experts argument rules, each naming its flag."""
    problems = moe_flags.problems(a)
    e, k = a.num_experts, a.moe_router_topk
    if e is None:
        return problems

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(e > 0, f"--num-experts must be positive, got {e}")
    need(0 < k <= max(e, 1), f"--moe-router-topk {k} must be in [1, --num-experts {e}]")
    freq = a.moe_layer_freq
    if isinstance(freq, int):
        need(freq > 0, f"--moe-layer-freq must be positive, got {freq}")
    else:
        need(
            len(freq) == a.num_layers,
            f"--moe-layer-freq: the pattern has {len(freq)} entries for --num-layers "
            f"{a.num_layers}; give one per layer",
        )
    ffn = a.moe_ffn_hidden_size or a.ffn_hidden_size
    need(
        a.moe_ffn_hidden_size is None or a.moe_ffn_hidden_size > 0,
        "--moe-ffn-hidden-size must be positive",
    )
    need(
        ffn is None or ffn % tp == 0,
        f"--moe-ffn-hidden-size {ffn} must be divisible by --tensor-model-parallel-size {tp}",
    )
    shared = a.moe_shared_expert_intermediate_size
    need(
        shared is None or (shared > 0 and shared % tp == 0),
        f"--moe-shared-expert-intermediate-size {shared} must be positive and divisible by "
        f"--tensor-model-parallel-size {tp}",
    )
    need(
        not a.moe_shared_expert_gate or shared,
        "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size",
    )
    groups, group_topk = a.moe_router_num_groups, a.moe_router_group_topk
    if groups or group_topk:
        need(
            bool(groups) and bool(group_topk),
            "--moe-router-num-groups and --moe-router-group-topk go together",
        )
        if groups and group_topk and e > 0:
            need(e % groups == 0, f"--moe-router-num-groups {groups} must divide --num-experts {e}")
            need(
                group_topk <= groups,
                f"--moe-router-group-topk {group_topk} exceeds --moe-router-num-groups {groups}",
            )
            need(
                e % groups or (k % group_topk == 0 and k // group_topk <= max(e // groups, 1)),
                f"--moe-router-topk {k} must be a multiple of --moe-router-group-topk "
                f"{group_topk}, taking at most {e // groups} experts (one group's) from each group",
            )
    need(
        a.moe_expert_capacity_factor is None or a.moe_expert_capacity_factor > 0,
        "--moe-expert-capacity-factor must be positive",
    )
    need(
        not a.moe_pad_expert_input_to_capacity or a.moe_expert_capacity_factor is not None,
        "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
    )
    need(min(a.moe_aux_loss_coeff) >= 0, "--moe-aux-loss-coeff must be >= 0")
    return problems
