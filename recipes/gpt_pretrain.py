"""Pretrain a GPT under torchrun with any tensor/sequence/pipeline/data-parallel layout.

    torchrun --nproc-per-node 4 -m recipes.gpt_pretrain --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2
    python -m recipes.gpt_pretrain --config run.yaml --train-iters 50        # one process

The runner holds the state (process groups, files, clocks); everything else is a pure function from fmeg.
Parameters are initialised as on one device and then sharded, so the loss curve does not depend on the
layout. Arguments are checked before any process group is created.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fmeg import optim, tree
from fmeg.data.blending import build_datasets
from fmeg.data.default_corpus import default_corpus
from fmeg.data.tokenizers import build_tokenizer, padded_vocab_size
from fmeg.log_line import megatron_log_line
from fmeg.models import gpt
from fmeg.ops import fold_in
from fmeg.parallel.mesh import Mesh
from fmeg.training.arguments import parse_args, validate
from fmeg.training import loss_scale
from fmeg.training.parallel_step import Layout, init_state, shard_params, train_iteration


def model_config(a, vocab_size: int) -> gpt.GPTConfig:
    return gpt.GPTConfig(
        vocab_size=vocab_size, max_seq_len=a.max_position_embeddings or a.seq_length, num_layers=a.num_layers,
        hidden_size=a.hidden_size, num_heads=a.num_attention_heads, num_kv_heads=a.num_query_groups,
        ffn_hidden_size=a.ffn_hidden_size, norm="rmsnorm" if a.normalization == "RMSNorm" else "layernorm",
        activation="swiglu" if a.swiglu else "gelu",
        position="rope" if a.position_embedding_type == "rope" else "learned",
        tie_embeddings=not a.untie_embeddings_and_output_weights, bias=not a.disable_bias_linear,
        init_std=a.init_method_std, hidden_dropout=a.hidden_dropout)


def collate(samples: list[dict]) -> dict:
    return {k: torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask")}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    problems = validate(a, world)
    if problems:
        if rank == 0:
            for p in problems:
                print(f"error: {p}", file=sys.stderr)
        return 2
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
        mesh = Mesh.from_torch_distributed(tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size)
    else:
        mesh = Mesh.single()
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    dp = world // (tp * pp)
    chunks = (a.num_layers // pp) // a.num_layers_per_virtual_pipeline_stage \
        if a.num_layers_per_virtual_pipeline_stage else 1
    layout = Layout(tp, pp, chunks, dp, a.sequence_parallel, a.pipeline_schedule)
    last_rank = rank == world - 1
    torch.manual_seed(a.seed)

    tokenizer = build_tokenizer(a.tokenizer_type, model=a.tokenizer_model, vocab_file=a.vocab_file,
                                merge_file=a.merge_file)
    data_path = a.data_path or [default_corpus().prefix]
    vocab = a.padded_vocab_size or padded_vocab_size(tokenizer.vocab_size, tp, a.make_vocab_size_divisible_by)
    config = model_config(a, vocab)
    gbs = a.global_batch_size or a.micro_batch_size * dp
    microbatches = gbs // (a.micro_batch_size * dp)
    train_data = build_datasets(data_path, a.split, a.seq_length, [a.train_iters * gbs, 0, 0], a.seed,
                                cache_dir=a.data_cache_path, eod_id=tokenizer.eod, eod_mask_loss=a.eod_mask_loss)[0]

    params = shard_params(gpt.init(config, a.seed), config, layout, mesh)
    opt = optim.adamw(a.adam_beta1, a.adam_beta2, a.adam_eps)
    compute_dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
    params, opt_state, zero = init_state(params, config, layout, mesh, opt, distributed=a.use_distributed_optimizer,
                                         compute_dtype=compute_dtype, adam=(a.adam_beta1, a.adam_beta2, a.adam_eps))
    scaler = loss_scale.initial(a.initial_loss_scale, a.min_loss_scale, a.loss_scale_window, a.hysteresis) \
        if a.fp16 else None
    skipped = 0
    schedule = optim.LRSchedule(max_lr=a.lr, min_lr=a.min_lr, warmup_steps=a.lr_warmup_iters,
                                decay_steps=a.lr_decay_iters or a.train_iters, style=a.lr_decay_style)
    if last_rank:
        local = tree.num_params(params)
        state_bytes = sum(x.numel() * x.element_size() for x in tree.tree_leaves(
            (opt_state["adam"].mu, opt_state["adam"].nu, opt_state.get("main", ()))))
        print(f"fmeg gpt_pretrain: world {world} = tp {tp} x pp {pp} (x{chunks} virtual) x dp {dp}"
              f"{', sequence parallel' if layout.sequence_parallel else ''}; {config.num_layers} layers, hidden "
              f"{config.hidden_size}, vocab {vocab}; {local / 1e6:.2f}M parameters on this rank; global batch "
              f"{gbs} = {microbatches} microbatches x {a.micro_batch_size} x dp {dp}; optimizer state {state_bytes:,} bytes "
              f"on this rank{' (distributed optimizer)' if zero else ''}", flush=True)
    metrics_file = None
    if a.log_dir and last_rank:
        Path(a.log_dir).mkdir(parents=True, exist_ok=True)
        metrics_file = open(Path(a.log_dir) / "metrics.jsonl", "w")  # noqa: SIM115 - closed below
    dp_rank, losses, start = mesh.coord("dp"), [], time.perf_counter()
    tick = start
    for iteration in range(1, a.train_iters + 1):
        consumed = (iteration - 1) * gbs
        batch = []
        for j in range(microbatches):
            first = consumed + (j * dp + dp_rank) * a.micro_batch_size
            mb = collate([train_data[i] for i in range(first, first + a.micro_batch_size)])
            if a.hidden_dropout:
                mb["dropout_key"] = fold_in(a.seed, iteration, j * dp + dp_rank)
            batch.append(mb)
        lr = schedule(iteration - 1)
        scale = scaler.scale if scaler else 1.0
        params, opt_state, m = train_iteration(params, opt_state, batch, config=config, layout=layout, mesh=mesh,
                                               optimizer=opt, lr=lr, weight_decay=a.weight_decay,
                                               clip_grad=a.clip_grad, zero=zero, loss_scale=scale,
                                               check_overflow=scaler is not None)
        skipped += int(m["skipped"])
        if scaler:
            scaler = loss_scale.update(scaler, m["skipped"])
        now = time.perf_counter()
        if last_rank:
            loss = float(m["loss"])  # reported for skipped steps too, as Megatron does
            losses.append(loss)
            record = {"iteration": iteration, "lm_loss": loss, "grad_norm": m["grad_norm"], "lr": lr,
                      "loss_scale": scale, "skipped": bool(m["skipped"]), "consumed_samples": iteration * gbs,
                      "elapsed_ms": (now - tick) * 1e3,
                      "tokens_per_s": gbs * a.seq_length / max(now - tick, 1e-9)}
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if iteration % a.log_interval == 0 or iteration == a.train_iters:
                print(megatron_log_line(iteration=iteration, train_iters=a.train_iters,
                                        consumed_samples=iteration * gbs, elapsed_ms=record["elapsed_ms"], lr=lr,
                                        global_batch_size=gbs, lm_loss=loss, grad_norm=m["grad_norm"],
                                        loss_scale=scale, skipped=skipped), flush=True)
        tick = now
    if last_rank:
        tail = losses[-10:]
        print(f"done: {a.train_iters} iterations in {time.perf_counter() - start:.1f} s; lm loss "
              f"{losses[0]:.3f} -> {sum(tail) / len(tail):.3f} (mean of the last {len(tail)})", flush=True)
        if metrics_file:
            metrics_file.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
