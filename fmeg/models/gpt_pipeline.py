"""The GPT cut into pipeline stages, as pure functions over the params pytree.

With pp ranks and vp model chunks per rank there are S = pp * vp stages; stage s = chunk * pp + rank
holds the decoder layers after those of stages 0 .. s - 1, as many as `stages` gives it: an int S
splits the L layers evenly (L / S each, so chunk c of rank r starts at layer c * (L / vp) + r *
(L / pp / vp), Megatron's offset), a tuple names each stage's count (Megatron's uneven layouts; a
stage may hold none and pass its activations on). Stage 0 also holds the embeddings, stage S - 1
the final norm, the output layer and the multi-token prediction layers (fmeg.models.mtp). Stage
S - 1 holds a copy of the word embedding when it needs one (embedding_copy): as output.weight with
tied embeddings, as mtp_embedding.weight for untied MTP layers' inputs; the two gradients are
summed between the first and last stage (sync_tied_embedding_grads).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from fmeg.models import gpt, moe, mtp
from fmeg.models.gpt import GPTConfig, Params
from fmeg.parallel.pipeline.segments import Segment, compose, recompute_units
from fmeg.parallel.tensor import NO_TP, TensorParallel


# S stages of equal size, or each stage's decoder layers in forward order
Stages = int | tuple[int, ...]


def stage_counts(config: GPTConfig, stages: Stages) -> tuple[int, ...]:
    """The decoder layers of each stage; ValueError when they do not add up to the model's."""
    if isinstance(stages, int):
        if stages < 1 or config.num_layers % stages:
            raise ValueError(
                f"GPTConfig.num_layers={config.num_layers} must be divisible by the {stages} "
                "pipeline stages (pipeline size * virtual stages), or give each stage's layers"
            )
        return (config.num_layers // stages,) * stages
    if sum(stages) != config.num_layers or min(stages, default=-1) < 0:
        raise ValueError(
            f"the stages' decoder layers {list(stages)} must be counts adding up to "
            f"GPTConfig.num_layers={config.num_layers}"
        )
    return tuple(stages)


def num_stages(stages: Stages) -> int:
    return stages if isinstance(stages, int) else len(stages)


def stage_layers(config: GPTConfig, stage: int, stages: Stages) -> range:
    """The model's indices of the decoder layers stage `stage` holds."""
    counts = stage_counts(config, stages)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def embedding_copy(config: GPTConfig) -> str | None:
    """The path of the last stage's copy of the word embedding (on every layout, one stage
    included): the tied output layer, or the multi-token prediction layers' input table when the
    output layer is untied."""
    if config.tie_embeddings:
        return "output.weight"
    return "mtp_embedding.weight" if config.mtp_depth else None


def split(params: Params, config: GPTConfig, stages: Stages) -> dict[int, Params]:
    """{stage: that stage's params} for all stages (pp * vp of them)."""
    last = num_stages(stages) - 1
    out = {}
    for s in range(last + 1):
        p: Params = {"layers": [params["layers"][i] for i in stage_layers(config, s, stages)]}
        if s == 0:
            p["embedding"] = params["embedding"]
        if s == last:
            p["final_norm"] = params["final_norm"]
            p["output"] = {"weight": gpt.output_weight(params, config)}
            if config.mtp_depth:
                p["mtp"] = params["mtp"]
                if not config.tie_embeddings:
                    p["mtp_embedding"] = {"weight": params["embedding"]["word"]["weight"]}
        out[s] = p
    return out


def stage_units(config: GPTConfig, stage: int, stages: Stages) -> list[str]:
    """The units of gpt.init (its `only`) whose weights split() puts in the stage: the last stage's
    copy of the word embedding is the embedding's."""
    first, last = stage == 0, stage == num_stages(stages) - 1
    return (
        (["embedding"] if first or (last and embedding_copy(config)) else [])
        + [f"layers.{i}" for i in stage_layers(config, stage, stages)]
        + (
            ["final_norm"]
            + ([] if config.tie_embeddings else ["output"])
            + (["mtp"] if config.mtp_depth else [])
            if last
            else []
        )
    )


def merge(stage_trees: dict[int, Params], config: GPTConfig) -> Params:
    """Inverse of split for params or gradients; the tied output copy is dropped (its gradient must
    already be summed into the word embedding's: sync_tied_embedding_grads)."""
    stages = len(stage_trees)
    full: Params = {
        "embedding": stage_trees[0]["embedding"],
        "layers": [lp for s in range(stages) for lp in stage_trees[s]["layers"]],
        "final_norm": stage_trees[stages - 1]["final_norm"],
    }
    # in gpt.init's order
    if config.mtp_depth:
        full["mtp"] = stage_trees[stages - 1]["mtp"]
    if not config.tie_embeddings:
        full["output"] = stage_trees[stages - 1]["output"]
    return full


def stage_segments(
    config: GPTConfig,
    stage: int,
    stages: Stages,
    tp: TensorParallel = NO_TP,
    recompute: tuple[str, str | None, int | None] | None = None,
    compile: str | None = None,
    per_token: bool = False,
    fused: bool = False,
    modules: tuple[str, ...] = ("core_attn",),
) -> list[Segment]:
    """The stage as a chain of segments (embeddings, each layer, final norm + loss), so that
    backward can hand over each piece's gradients as soon as they are final. Params may be
    tensor-parallel shards (tp); activations are [b, s, h] ([b, s/t, h] with sequence parallelism).
    batch holds tokens, labels and loss_mask, and optionally a dropout key, and for mixtures of
    experts loss_seed (the backward seed of the microbatch's loss, which the auxiliary losses'
    gradients take) and moe_metrics (where they write their values: fmeg.models.moe.AuxLosses).
    recompute = Megatron's (granularity, method, layers): ("full", method, layers) recomputes whole
    layers (segments.recompute_units), ("selective", None, None) the modules Megatron's
    --recompute-modules names (modules: SELECTIVE_MODULES, the attention core by default). compile:
    a torch.compile backend ("inductor"; "aot_eager" traces without code generation) that each piece
    runs under: regional compilation, one graph per kind of piece shared by every layer, collectives
    inside (torch.distributed groups: comm.TorchGroup; thread ranks do not trace), no graph break
    allowed. None runs eagerly. per_token: the head returns the sum of the token losses instead of
    their mean (Megatron's --calculate-per-token-loss; the caller divides). fused: the whole stage
    as one segment (with compile, one graph): nothing can be handed over before the stage's backward
    ends, but the per-layer calls (guards, autograd wrappers, gradient hand-over) are gone, which is
    what a host-bound step needs. Not with full recomputation, whose units are segments."""
    layers = stage_layers(config, stage, stages)
    last = stage == num_stages(stages) - 1
    granularity, method, count = recompute or (None, None, None)
    unit_of = recompute_units(len(layers), method if granularity == "full" else None, count)
    selective = frozenset(modules) if granularity == "selective" else frozenset()
    if fused:
        if any(u is not None for u in unit_of):
            raise ValueError(
                "fused stage segments cannot recompute whole layers (--recompute-granularity full)"
            )
        return [
            Segment(
                _fused_stage(
                    config, tp, selective, per_token, compile, stage == 0, last, layers.start
                )
            )
        ]
    embedding, layer_fn, head = (
        _compiled_pieces(config, tp, selective, per_token, compile)
        if compile
        else _pieces(config, tp, selective, per_token)
    )

    def layer(i: int) -> Segment:
        key = f"layers.{i}"
        return Segment(
            lambda sub, x, batch: layer_fn(sub[key], x, batch, layers.start + i), (key,), unit_of[i]
        )

    segments = (
        [Segment(lambda sub, x, batch: embedding(sub, batch), ("embedding",))] if stage == 0 else []
    )
    segments += [layer(i) for i in range(len(layers))]
    if last:
        segments.append(Segment(head, head_keys(config)))
    return segments


# Megatron's --recompute-modules: the pieces of a layer selective recomputation can run again in
# backward
SELECTIVE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)


def head_keys(config: GPTConfig) -> tuple[str, ...]:
    """The last stage's parameters its loss segment differentiates: the final norm, the output
    layer, and the multi-token prediction layers with their copy of the word embedding."""
    extra = (
        ("mtp",) + (("mtp_embedding",) if not config.tie_embeddings else ())
        if config.mtp_depth
        else ()
    )
    return ("final_norm", "output") + extra


def _pieces(
    config: GPTConfig, tp: TensorParallel, recompute: frozenset[str], per_token: bool = False
) -> tuple[Callable, Callable, Callable]:
    """The three kinds of segment body: embedding(sub, batch), layer(layer_params, x, batch, index)
    and head(sub, x, batch) -> the microbatch's loss (with multi-token prediction: its value, and
    the gradient of the objective, fmeg.models.mtp.with_objective)."""

    def aux_of(batch: dict) -> moe.AuxLosses:
        return moe.AuxLosses(
            batch.get("loss_seed", 1.0),
            batch.get("moe_metrics"),
            batch.get("moe_counts"),
            batch.get("moe_global_counts"),
            batch.get("moe_one_hot"),
            batch.get("moe_seen"),
            batch.get("router_key"),
            batch.get("padding_mask"),
        )

    def span(
        params: Params,
        x: torch.Tensor | None,
        batch: dict,
        first_layer: int = 0,
        final: bool = False,
    ) -> torch.Tensor:
        return gpt.decoder_span(
            params,
            batch["tokens"],
            x,
            config,
            first_layer=first_layer,
            final=final,
            key=batch.get("dropout_key"),
            tp=tp,
            recompute=recompute,
            aux=aux_of(batch),
            positions=batch.get("position_ids"),
            documents=batch.get("cu_seqlens"),
        )

    def embedding(sub: Params, batch: dict) -> torch.Tensor:
        return span({"embedding": sub["embedding"], "layers": []}, None, batch)

    def layer(layer_params: Params, x: torch.Tensor, batch: dict, index: int) -> torch.Tensor:
        return span({"layers": [layer_params]}, x, batch, index)

    def head(sub: Params, x: torch.Tensor, batch: dict) -> torch.Tensor:
        x = span({"layers": [], "final_norm": sub["final_norm"]}, x, batch, final=True)
        reduction = "sum" if per_token else "mean"
        main = gpt.output_loss(
            x, sub["output"]["weight"], batch, config.vocab_size, tp=tp, reduction=reduction
        )
        if not config.mtp_depth:
            return main
        losses = mtp.depth_losses(
            sub,
            x,
            batch,
            config,
            tp=tp,
            key=batch.get("dropout_key"),
            aux=aux_of(batch),
            recompute=recompute,
            reduction=reduction,
        )
        return mtp.with_objective(main, losses, config)

    return embedding, layer, head


@functools.cache
def _compiled_pieces(
    config: GPTConfig, tp: TensorParallel, recompute: frozenset[str], per_token: bool, backend: str
) -> tuple[Callable, ...]:
    """_pieces under torch.compile(fullgraph=True), made once per arguments so that every iteration
    and stage reuses the compiled graphs (the layer index becomes a symbolic int at the second
    layer, so all layers share one graph after the first)."""
    return tuple(_compile(fn, backend) for fn in _pieces(config, tp, recompute, per_token))


@functools.cache
def _fused_stage(
    config: GPTConfig,
    tp: TensorParallel,
    recompute: frozenset[str],
    per_token: bool,
    backend: str | None,
    first: bool,
    last: bool,
    first_layer: int,
) -> Callable:
    """The stage's pieces chained in one function (sub: the whole stage params), compiled as one
    graph when a backend is given; made once per arguments so that every iteration reuses the
    graph."""
    embedding, layer, head = _pieces(config, tp, recompute, per_token)

    def stage(params: Params, x: torch.Tensor | None, batch: dict) -> torch.Tensor:
        if first:
            x = embedding(params, batch)
        for i, layer_params in enumerate(params["layers"]):
            x = layer(layer_params, x, batch, first_layer + i)
        return head(params, x, batch) if last else x

    return _compile(stage, backend) if backend else stage


# Inductor inlines a pointwise node into each of its readers, so a chain whose steps read their
# input twice (dropout's counter hash: x ^ (x >> 16), ...) is expanded once per path through it,
# 2^k times: minutes of codegen for each dropout site. Realizing any node of more than this many
# ops bounds the expansion (a dropout site compiles in seconds) and leaves ordinary chains fused.
_REALIZE_OPCOUNT = 30


def _compile(fn: Callable, backend: str) -> Callable:
    """fn under torch.compile(fullgraph=True), inductor's expansion bounded."""
    options = {"realize_opcount_threshold": _REALIZE_OPCOUNT} if backend == "inductor" else None
    return torch.compile(fn, backend=backend, fullgraph=True, options=options)


def stage_fn(config: GPTConfig, stage: int, stages: Stages, tp: TensorParallel = NO_TP) -> Callable:
    """(params, x, batch) -> activations, or the microbatch's loss on the last stage: the stage's
    segments run one after the other (x is None on stage 0)."""
    return compose(stage_segments(config, stage, stages, tp))


def sync_tied_embedding_grads(
    grads: dict[int, Params], config: GPTConfig, stages: Stages, embedding_group: Any = None
) -> dict[int, Params]:
    """Sum the word-embedding gradient of stage 0 and the gradient of the last stage's copy of it
    (embedding_copy), so both copies get the same update (Megatron's embedding-group all-reduce).
    grads holds this rank's stages."""
    copy = embedding_copy(config)
    if copy is None:
        return grads
    first, last = 0, num_stages(stages) - 1
    owner, leaf = copy.split(".")
    # both copies on this rank: no communication
    if first in grads and last in grads:
        total = grads[first]["embedding"]["word"]["weight"] + grads[last][owner][leaf]
        grads[first]["embedding"]["word"]["weight"] = grads[last][owner][leaf] = total
    elif first in grads:
        word = grads[first]["embedding"]["word"]
        word["weight"] = embedding_group.all_reduce(word["weight"])
    elif last in grads:
        grads[last][owner][leaf] = embedding_group.all_reduce(grads[last][owner][leaf])
    return grads


def reference_loss_and_grads(params: Params, microbatches: list[dict], config: GPTConfig) -> tuple:
    """The single-device mean of the microbatch losses and its gradients (what a pipeline must
    equal)."""

    def mean_loss(p):
        return sum(mtp.loss(p, mb, config, key=mb.get("dropout_key")) for mb in microbatches) / len(
            microbatches
        )

    grads, loss = torch.func.grad_and_value(mean_loss)(params)
    return loss, grads
