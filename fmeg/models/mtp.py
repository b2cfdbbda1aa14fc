"""Multi-token prediction (DeepSeek-V3's MTP, megatron-core's MultiTokenPredictionBlock) as pure
functions.

Depth k = 1..D starts from h_0, the decoder's final-normed hidden states, and the input shifted k
places left:

    h_k    = final_norm_k(layer_k(eh_proj_k([enorm_k(embed(shift^k(tokens))), hnorm_k(h_{k-1})])))
    loss_k = cross entropy of output(h_k) against shift^k(labels), over shift^k(loss_mask)

`shift` moves a row one place left and writes 0 at its end, and at the end of each packed document,
so the last k places of a row (of a document) count no loss at depth k (megatron-core's
roll_tensor). The embedding and the output layer are the model's. Training minimises lm loss +
mtp_loss_scaling_factor / D * sum_k loss_k, each loss a microbatch mean as the main one is (or a sum
of token losses with --calculate-per-token-loss); the reported loss stays the language model's, and
megatron-core's "mtp_k loss" is logged apart (with_objective).

Parameters: params["mtp"][k - 1] = {"enorm", "hnorm", "eh_proj": {"weight": [H, 2H]}, "layer": a
decoder layer (numbered num_layers + k - 1; a mixture of experts when the last decoder layer is
one), "final_norm"}. They live on the last pipeline stage, which also holds the output layer and a
copy of the word embedding: the tied output layer, or, untied, "mtp_embedding"
(gpt_pipeline.embedding_copy), whose gradient is summed with the embedding's.

Sharding contract: eh_proj is column-parallel (its output rows split over tp) and its output
gathered, as in megatron-core; under sequence parallelism each rank then keeps its sequence chunk,
as the layer expects. Under context parallelism the shifts gather the (gradient-free) tokens, labels
and masks over cp, shift the whole sequence and take this rank's chunks back; each rank's loss is
its tokens' share of the microbatch's mean.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fmeg import ops
from fmeg.models import gpt, moe
from fmeg.parallel import collectives as C
from fmeg.parallel.context import ContextParallel, positions
from fmeg.parallel.tensor import NO_TP, TensorParallel, column_parallel_linear, hidden_dropout

Params = dict[str, Any]


def shift_left(
    x_BS: torch.Tensor, documents: torch.Tensor | None, cp: ContextParallel
) -> torch.Tensor:
    """x one place left along the sequence, 0 at each row's end (and each packed document's:
    documents are host cu_seqlens [b, s + 1] of the whole sequence). x holds this rank's
    context-parallel tokens: the whole sequence is gathered over cp, shifted, and this rank's tokens
    taken back. x is data (no gradient)."""
    whole = x_BS
    if cp.size > 1:
        seq = x_BS.shape[1] * cp.size
        order = torch.cat([positions(seq, cp.size, r, x_BS.device) for r in range(cp.size)])
        whole = C.all_gather_constant(x_BS, cp.group, dim=1)[:, torch.argsort(order)]
    seq = whole.shape[1]
    ends = torch.zeros(whole.shape[0], seq, dtype=torch.bool, device=whole.device)
    ends[:, -1] = True
    if documents is not None:
        ends.scatter_(1, (documents[:, 1:].to(whole.device) - 1).clamp(0, seq - 1), True)
    shifted = torch.roll(whole, -1, dims=1).masked_fill(ends, 0)
    return shifted if cp.size == 1 else shifted[:, positions(seq, cp.size, cp.rank, x_BS.device)]


def embedding_table(params: Params, config) -> torch.Tensor:
    """The word embedding the depths look their tokens up in: the last stage's copy, or the model's
    own."""
    if "mtp_embedding" in params:
        return params["mtp_embedding"]["weight"]
    return (
        params["output"]["weight"]
        if config.tie_embeddings and "output" in params
        else params["embedding"]["word"]["weight"]
    )


def output_table(params: Params, config) -> torch.Tensor:
    return params["output"]["weight"] if "output" in params else gpt.output_weight(params, config)


def combine(
    p: Params,
    embedded_BSH: torch.Tensor,
    hidden_BSH: torch.Tensor,
    config,
    tp: TensorParallel = NO_TP,
) -> torch.Tensor:
    """eh_proj([enorm(embedded), hnorm(hidden)]): column-parallel, gathered, and cut back to this
    rank's sequence chunk under sequence parallelism."""
    x = torch.cat(
        [
            gpt.norm(p["enorm"], embedded_BSH, config, tp),
            gpt.norm(p["hnorm"], hidden_BSH, config, tp),
        ],
        -1,
    )
    x = column_parallel_linear(x, p["eh_proj"]["weight"], None, tp, gather_output=True)
    return C.scatter_to(x, tp.group, dim=1) if tp.sp else x


def depth_losses(
    params: Params,
    x_BSH: torch.Tensor,
    batch: dict,
    config,
    *,
    tp: TensorParallel = NO_TP,
    key: Any = None,
    aux: moe.AuxLosses = moe.NO_AUX,
    recompute: frozenset[str] = frozenset(),
    reduction: str = "mean",
) -> list[torch.Tensor]:
    """[loss_1, ..., loss_D] from the decoder's final-normed hidden states x (this rank's, [b, s/t,
    h] under sp), each as gpt.output_loss gives it (reduction "sum": the sum of the depth's counted
    token losses). params: the last stage's (or the whole model's). Each depth's mean (this rank's
    share under cp) is written to batch["mtp_metrics"][k] when the batch has that buffer."""
    cp, documents = tp.context, batch.get("cu_seqlens")
    # megatron-core's MTP block routes without the padding mask
    aux = dataclasses.replace(aux, padding=None)
    tokens, labels = batch["tokens"], batch["labels"]
    mask = batch.get("loss_mask")
    mask = torch.ones(labels.shape, device=labels.device) if mask is None else mask
    rope = gpt.layer_rope(tokens, config, batch.get("position_ids"), tp)
    table, out_weight, metrics = (
        embedding_table(params, config),
        output_table(params, config),
        batch.get("mtp_metrics"),
    )
    losses = []
    for k, p in enumerate(params["mtp"]):
        tokens, labels, mask = (shift_left(t, documents, cp) for t in (tokens, labels, mask))
        embedded = gpt.embed({"embedding": {"word": {"weight": table}}}, tokens, config, None, tp)
        if key is not None:
            embedded = hidden_dropout(
                embedded, config.hidden_dropout, ops.fold_in(key, -2 - k, 0), tp
            )
        x_BSH = combine(p, embedded, x_BSH, config, tp)
        x_BSH = gpt.layer(
            p["layer"],
            x_BSH,
            config,
            rope=rope,
            key=key,
            index=config.num_layers + k,
            tp=tp,
            recompute=recompute,
            aux=aux,
            documents=documents,
        )
        x_BSH = gpt.norm(p["final_norm"], x_BSH, config, tp)
        shifted = {"labels": labels, "loss_mask": mask}
        loss = gpt.output_loss(
            x_BSH, out_weight, shifted, config.vocab_size, tp=tp, reduction=reduction
        )
        if metrics is not None:
            mean = loss.detach()
            # this rank's share of the microbatch's mean
            if reduction == "sum":
                mean = mean / C.all_reduce_constant(
                    gpt.loss_tokens(shifted).to(mean.device), cp.group
                ).clamp_min(1.0)
            metrics[k] = mean
        losses.append(loss)
    return losses


def with_objective(main: torch.Tensor, losses: list[torch.Tensor], config) -> torch.Tensor:
    """main's value, with the gradient of main + mtp_loss_scaling_factor / D * sum(losses): the MTP
    losses get the main loss's backward seed, whatever it is (megatron-core's MTPLossAutoScaler)."""
    extra = config.mtp.loss_scaling_factor / config.mtp_depth * torch.stack(losses).sum()
    return main + (extra - extra.detach())


def loss(
    params: Params, batch: dict, config, *, key: Any = None, tp: TensorParallel = NO_TP
) -> torch.Tensor:
    """gpt.loss with the MTP depths' losses in its gradient (its value: the language model's loss).
    The one-device reference of what a pipeline's last stage computes."""
    x = gpt.hidden_states(
        params,
        batch["tokens"],
        config,
        key=key,
        tp=tp,
        positions=batch.get("position_ids"),
        documents=batch.get("cu_seqlens"),
    )
    main = gpt.output_loss(x, gpt.output_weight(params, config), batch, config.vocab_size, tp=tp)
    if not config.mtp_depth:
        return main
    return with_objective(main, depth_losses(params, x, batch, config, tp=tp, key=key), config)


def values(params: Params, batch: dict, config) -> list[float]:
    """Each depth's loss on one device, as megatron-core logs it ("mtp_k loss"), forward only."""
    with torch.no_grad():
        x = gpt.hidden_states(
            params,
            batch["tokens"],
            config,
            positions=batch.get("position_ids"),
            documents=batch.get("cu_seqlens"),
        )
        return [v.item() for v in depth_losses(params, x, batch, config)]
