"""Pretrain a GPT under torchrun with any tensor/sequence/pipeline/data-parallel layout.

    torchrun --nproc-per-node 4 -m recipes.gpt_pretrain --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2
    python -m recipes.gpt_pretrain --config run.yaml --train-iters 50        # one process

The runner holds the state (process groups, files, clocks); everything else is a pure function from fmeg.
Parameters are initialised as on one device and then sharded, so the loss curve does not depend on the
layout. Arguments are checked before any process group is created.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import resource
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from fmeg import __version__, checkpoint, optim, tree
from fmeg.data.blending import build_datasets, target_samples
from fmeg.data.default_corpus import default_corpus
from fmeg.data.mock_corpus import mock_corpus
from fmeg.data.tokenizers import padded_vocab_size, tokenizer_from_flags
from fmeg.log_line import megatron_log_line
from fmeg.models import gpt
from fmeg.ops import fold_in
from fmeg.parallel.mesh import Mesh
from fmeg.training.arguments import batch_geometry, lr_steps, parse_args, validate
from fmeg.training.megatron_flags import activation, ignored_flags
from fmeg.training import loss_scale
from fmeg.training.batch_schedule import global_batch_size
from fmeg.training.parallel_step import Layout, evaluate, global_norm, init_state, shard_params, train_iteration
from fmeg.training.report import draw_loss_curve, memory_estimate, model_flops


def model_config(a, vocab_size: int) -> gpt.GPTConfig:
    """The model of the flags for a tokenizer of vocab_size ids, padded as Megatron pads for this tp (the
    padding changes no number: gpt.GPTConfig.padded_vocab_size)."""
    padded = a.padded_vocab_size or padded_vocab_size(vocab_size, a.tensor_model_parallel_size,
                                                      a.make_vocab_size_divisible_by)
    return gpt.GPTConfig(
        vocab_size=vocab_size, padded_vocab_size=padded, max_seq_len=a.max_position_embeddings or a.seq_length,
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_heads=a.num_attention_heads, num_kv_heads=a.num_query_groups,
        ffn_hidden_size=a.ffn_hidden_size, norm="rmsnorm" if a.normalization == "RMSNorm" else "layernorm",
        activation=activation(a),
        norm_eps=a.norm_epsilon, norm_zero_centered=a.apply_layernorm_1p, rope_theta=a.rotary_base,
        kv_channels=a.kv_channels, rotary_percent=a.rotary_percent,
        position="rope" if a.position_embedding_type == "rope" else "learned",
        tie_embeddings=not a.untie_embeddings_and_output_weights, bias=not a.disable_bias_linear,
        init_std=a.init_method_std, hidden_dropout=a.hidden_dropout,
        attention_dropout=a.attention_dropout)


def choose_device(requested: str, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK (NCCL) when asked for or, with auto, when CUDA is available; else the CPU (gloo)."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def gpu_peak(device: torch.device) -> str:
    return f", of {device} {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MB" if device.type == "cuda" else ""


def to_device(values, device: torch.device):
    return tree.tree_map(lambda t: t.to(device), values)


def resharded_state(path, meta, config, layout, mesh, state, device):
    """A checkpoint of another layout, for this rank, as state.load takes it: full tensors rebuilt from every
    shard, then cut the way this layout cuts them (tensor-parallel shards of this rank's stages and, with
    the distributed optimizer, its slice of the flat layout)."""
    full = checkpoint.full_state(path, meta, config)
    master = "main" if "main" in full else "params"  # the fp32 weights, when the checkpoint has them

    def local(name):
        trees = to_device(shard_params(full[name], config, layout, mesh), device)
        return {"shard": state.flat.shard(state.flat.flatten(trees), mesh.coord("dp"))} if state.zero else trees

    weights = to_device(shard_params(full[master], config, layout, mesh), device)
    return weights, {"adam": optim.AdamState(full["count"], local("mu"), local("nu")), "main": local(master)}


def exit_reason(a, iteration: int, start: float, signalled: bool, world: int, device: torch.device) -> str | None:
    """Why to stop after this iteration (all ranks agree: any rank's reason stops every rank), or None."""
    reasons = []
    if signalled:
        reasons.append("SIGTERM received")
    if a.exit_interval and iteration % a.exit_interval == 0:
        reasons.append(f"--exit-interval {a.exit_interval}")
    if a.exit_duration_in_mins is not None and (time.perf_counter() - start) / 60 >= a.exit_duration_in_mins:
        reasons.append(f"--exit-duration-in-mins {a.exit_duration_in_mins}")
    if world > 1 and (a.exit_signal_handler or a.exit_duration_in_mins is not None):
        flag = torch.tensor([float(bool(reasons))], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not reasons:
            reasons.append("another rank is exiting")
    return "; ".join(reasons) or None


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
    dp, gbs = batch_geometry(a, world)
    try:
        tokenizer = tokenizer_from_flags(a.tokenizer_type, lambda name: getattr(a, name, None))
    except ValueError as e:  # a missing or unreadable tokenizer file: one line
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    data_path = a.data_path or [(mock_corpus(tokenizer.vocab_size, tokenizer.eod) if a.mock_data
                                 else default_corpus()).prefix]
    if a.padded_vocab_size is not None and a.padded_vocab_size < tokenizer.vocab_size:
        if rank == 0:
            print(f"error: --padded-vocab-size {a.padded_vocab_size} is smaller than the tokenizer's vocabulary "
                  f"({tokenizer.vocab_size}); raise it or leave it out", file=sys.stderr)
        return 2
    config = model_config(a, tokenizer.vocab_size)
    samples = target_samples(a.train_iters, gbs, a.eval_interval or 0, a.eval_iters if a.eval_interval else 0)
    try:  # the data is read and checked before any process group exists: a bad file is one line and exit 2
        train_data, valid_data, _ = build_datasets(data_path, a.split, a.seq_length, [samples[0], samples[1], 0],
                                                   a.seed, cache_dir=a.data_cache_path, eod_id=tokenizer.eod,
                                                   eod_mask_loss=a.eod_mask_loss, vocab_size=tokenizer.vocab_size)
    except ValueError as e:  # DataError, or a split / blend / sequence length the data cannot serve
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if train_data is None and samples[0]:
        if rank == 0:
            print(f"error: --data-path {' '.join(data_path)}: the training split has no documents (an empty dataset, "
                  f"or --split {a.split} gives it no share); give it data or a share", file=sys.stderr)
        return 2
    if a.eval_interval and a.eval_iters and valid_data is None:  # found now, not at the first evaluation
        if rank == 0:
            print(f"error: --split {a.split} leaves the validation split of {' '.join(data_path)} no documents; "
                  "give it a larger share, or leave out --eval-interval", file=sys.stderr)
        return 2

    device = choose_device(a.device, int(os.environ.get("LOCAL_RANK", "0")))
    compile_layers = "inductor" if (device.type == "cuda" if a.compile is None else a.compile) else None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=a.distributed_timeout_minutes),
                                device_id=device if device.type == "cuda" else None)
        mesh = Mesh.from_torch_distributed(tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size,
                                           device=device)
    else:
        mesh = Mesh.single()
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    chunks = (a.num_layers // pp) // a.num_layers_per_virtual_pipeline_stage \
        if a.num_layers_per_virtual_pipeline_stage else 1
    recompute = (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) \
        if a.recompute_granularity else None
    layout = Layout(tp, pp, chunks, dp, a.sequence_parallel, a.pipeline_schedule, recompute)
    last_rank = rank == world - 1
    torch.manual_seed(a.seed)

    compute_dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32

    # Megatron's gradient dtype: fp32 (bf16's default), bf16 (--grad-reduce-in-bf16), fp16 (fp16's default)
    grad_dtype = torch.bfloat16 if a.grad_reduce_in_bf16 else \
        torch.float16 if a.fp16 and not a.accumulate_allreduce_grads_in_fp32 else torch.float32

    def new_state(fp32_params):
        return init_state(fp32_params, config, layout, mesh, distributed=a.use_distributed_optimizer,
                          compute_dtype=compute_dtype, adam=(a.adam_beta1, a.adam_beta2, a.adam_eps),
                          grad_dtype=grad_dtype)

    state = new_state(to_device(shard_params(gpt.init(config, a.seed), config, layout, mesh), device))
    scaler = loss_scale.initial(a.initial_loss_scale, a.min_loss_scale, a.loss_scale_window, a.hysteresis) \
        if a.fp16 else None
    warmup_steps, decay_steps, in_samples = lr_steps(a)
    schedule = optim.LRSchedule(max_lr=a.lr, min_lr=a.min_lr, warmup_steps=warmup_steps, decay_steps=decay_steps,
                                style=a.lr_decay_style)
    decoupled_schedule = None if a.decoupled_lr is None else dataclasses.replace(
        schedule, max_lr=a.decoupled_lr, min_lr=a.min_lr if a.decoupled_min_lr is None else a.decoupled_min_lr)
    wd_schedule = optim.WeightDecaySchedule(
        start=a.weight_decay if a.start_weight_decay is None else a.start_weight_decay,
        end=a.weight_decay if a.end_weight_decay is None else a.end_weight_decay,
        incr_steps=(a.train_samples or a.train_iters * gbs) if in_samples else a.train_iters,
        style=a.weight_decay_incr_style)
    consumed, valid_consumed, first_iteration = 0, 0, 1
    scheduled = 0  # the LR and weight-decay schedules' position (samples or iterations): successful updates
    layout_meta = {"tp": tp, "pp": pp, "chunks": chunks, "dp": dp, "zero": a.use_distributed_optimizer,
                   "dtype": str(compute_dtype).removeprefix("torch.")}
    coords = {"tp": mesh.coord("tp"), "pp": mesh.coord("pp"), "dp": mesh.coord("dp")}
    if a.load:
        try:
            found = checkpoint.latest(a.load)
            meta = checkpoint.read_metadata(found, config) if found else None
        except checkpoint.CheckpointError as e:
            if rank == 0:
                print(f"error: {e}", file=sys.stderr)
            return 2
        if meta is None and last_rank:
            print(f"--load {a.load}: no checkpoint there yet ({checkpoint.LATEST} missing); starting from scratch",
                  flush=True)
        if meta is not None:
            if checkpoint.same_layout(meta, layout_meta, config):
                state.load(*to_device(checkpoint.local_state(found, meta, coords), device))
            else:
                state.load(*resharded_state(found, meta, config, layout, mesh, state, device))
            if a.finetune or a.no_load_optim:  # the weights only: a fresh optimizer state (fp32 main weights
                state = new_state(tree.tree_map(lambda x: x.float(), state.params))  # from the loaded ones)
            if not a.finetune:
                consumed, valid_consumed = meta["consumed_samples"], meta.get("valid_consumed_samples", 0)
                first_iteration = meta["iteration"] + 1
                # --no-load-optim: the LR and weight-decay schedules and the loss scaler start afresh too, as in
                # Megatron, where they are part of the optimizer state it does not load
                scheduled = 0 if a.no_load_optim else \
                    meta.get("scheduler_steps", consumed if in_samples else meta["iteration"])
                if scaler and meta.get("loss_scale") and not a.no_load_optim:
                    scaler = loss_scale.LossScale(**meta["loss_scale"])
            if last_rank:
                taken = "weights only" if a.finetune else "fresh optimizer state and schedules" if a.no_load_optim \
                    else "layout " + (
                    "unchanged" if checkpoint.same_layout(meta, layout_meta, config)
                    else f"resharded from {meta['layout']}")
                print(f"{'fine-tuning from' if a.finetune else 'resumed from'} {found} (iteration {meta['iteration']}, "
                      f"{meta['consumed_samples']} samples; {taken})", flush=True)

    attempt = "0"  # this run's token in temporary checkpoint names: a restart never writes into a dead run's
    if a.save:
        token = torch.tensor([secrets.randbits(48) if rank == 0 else 0], dtype=torch.int64, device=device)
        if world > 1:
            dist.broadcast(token, src=0)
        attempt = f"{int(token.item()):012x}"
        if rank == 0:
            for name in checkpoint.remove_stale(a.save):
                print(f"removed {Path(a.save) / name}: an interrupted save's leftovers", flush=True)
        if world > 1:
            dist.barrier()

    def save(iteration: int) -> bool:
        """Write a checkpoint; False (one line printed, the partial directory removed, the previous checkpoint
        untouched) when some rank could not write its part, e.g. on a full disk."""
        tensors = checkpoint.state_tensors(state.params, state.opt_state)
        if a.keep_last and a.keep_last > 1:  # space short for one more: make room first (keeping keep_last - 1)
            if rank == 0:
                newest = checkpoint.latest(a.save)
                if newest is not None and shutil.disk_usage(a.save).free < checkpoint.disk_bytes(newest):
                    for name in checkpoint.prune(a.save, a.keep_last - 1):
                        print(f"removed {Path(a.save) / name} before saving: the disk is short of space for "
                              f"--keep-last {a.keep_last}", flush=True)
            if world > 1:
                dist.barrier()
        problem = ""
        try:
            checkpoint.save_rank(a.save, iteration, rank, coords, tensors, sizes={"tp": tp, "pp": pp, "dp": dp},
                                 attempt=attempt)
        except (OSError, SafetensorError) as e:
            problem = " ".join(str(e).split())[:300]
        # in place of a barrier: which rank failed first (world if none), and the checkpoint's size
        status = torch.tensor([rank if problem else world, sum(t.numel() * t.element_size() for t in tensors.values())],
                              dtype=torch.int64, device=device)
        if world > 1:
            first_failed = status[:1].clone()
            dist.all_reduce(first_failed, op=dist.ReduceOp.MIN)
            dist.all_reduce(status[1:], op=dist.ReduceOp.SUM)
            status[0] = first_failed[0]
        if int(status[0]) < world:
            if rank == 0:
                shutil.rmtree(checkpoint.temporary_dir(a.save, iteration, attempt), ignore_errors=True)
            if world > 1:
                dist.barrier()
            if rank == int(status[0]):
                kept = checkpoint.latest(a.save)
                print(f"error: --save {a.save}: writing iteration {iteration} failed ({problem}); it needs about "
                      f"{int(status[1]) / 2**20:,.0f} MiB and {shutil.disk_usage(a.save).free / 2**20:,.0f} MiB are "
                      f"free; the partial checkpoint was removed and "
                      f"{kept.name if kept else 'no earlier checkpoint'} is intact", file=sys.stderr, flush=True)
            return False
        if rank == 0:
            checkpoint.finalize(a.save, iteration, {
                "world_size": world, "layout": layout_meta, "model": dataclasses.asdict(config),
                "consumed_samples": consumed, "valid_consumed_samples": valid_consumed, "scheduler_steps": scheduled,
                "loss_scale": dataclasses.asdict(scaler) if scaler else None,
                "arguments": {k: v for k, v in vars(a).items() if isinstance(v, (int, float, str, bool, list, type(None)))},
                "fmeg_version": __version__}, keep_last=a.keep_last, attempt=attempt)
        if world > 1:
            dist.barrier()
        if last_rank:
            print(f"saved checkpoint {checkpoint.iteration_dir(a.save, iteration)}", flush=True)
        return True

    local = tree.num_params(state.params)
    opt_state = state.opt_state
    state_bytes = sum(x.numel() * x.element_size() for x in tree.tree_leaves(
        (opt_state["adam"].mu, opt_state["adam"].nu, opt_state.get("main", ()))))
    reduced_in = "" if grad_dtype == torch.float32 else \
        f" (gradients reduced in {str(grad_dtype).removeprefix('torch.')})"
    if last_rank:
        in_flight = min(pp, gbs // (a.micro_batch_size * dp)) * chunks
        estimate = memory_estimate(local, state_bytes, config, a.micro_batch_size, a.seq_length, tp, pp, in_flight,
                                   torch.finfo(compute_dtype).bits // 8)
        print(f"fmeg gpt_pretrain on {device}: world {world} = tp {tp} x pp {pp} (x{chunks} virtual) x dp {dp}"
              f"{', sequence parallel' if layout.sequence_parallel else ''}"
              f"{', recompute ' + ' '.join(str(r) for r in recompute if r is not None) if recompute else ''}; "
              f"{config.num_layers} layers, hidden "
              f"{config.hidden_size}, vocab {config.vocab_size} (padded to {config.padded_vocab_size}), "
              f"{str(compute_dtype).removeprefix('torch.')}"
              f"{reduced_in}, "
              f"layers {'compiled' if compile_layers else 'eager'}; "
              f"{local / 1e6:.2f}M parameters on this rank; global batch {gbs}"
              f"{' (ramped up)' if a.rampup_batch_size else ''}; optimizer state {state_bytes:,} bytes on this rank"
              f"{' (distributed optimizer)' if state.zero else ''}; persistent state "
              f"{state.bytes_per_parameter():.2f} bytes per parameter", flush=True)
        for line in ignored_flags(a):
            print(f"ignored {line}", flush=True)
        for line in a.notices:
            print(f"warning: {line}", flush=True)
        print("theoretical memory on this rank (MB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in estimate.items()),
              flush=True)
    records: list[dict] = []
    metrics_file = None
    if a.log_dir and last_rank:
        Path(a.log_dir).mkdir(parents=True, exist_ok=True)
        metrics_file = open(Path(a.log_dir) / "metrics.jsonl", "w")  # noqa: SIM115 - closed below

    board = None
    if a.tensorboard_dir and last_rank:
        from torch.utils.tensorboard import SummaryWriter

        board = SummaryWriter(a.tensorboard_dir)

    def emit(record: dict) -> None:
        records.append(record)
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if board:
            for key in ("lm_loss", "validation_lm_loss", "grad_norm", "lr", "loss_scale", "tokens_per_s", "tflops"):
                if key in record and record[key] == record[key]:  # skip NaN
                    board.add_scalar(key.replace("_", " "), record[key], record["iteration"])

    def batches(dataset, first_sample: int, global_batch: int, iteration: int) -> list[dict]:
        out = []
        for j in range(global_batch // (a.micro_batch_size * dp)):
            first = first_sample + (j * dp + dp_rank) * a.micro_batch_size
            mb = to_device(collate([dataset[i] for i in range(first, first + a.micro_batch_size)]), device)
            if (a.hidden_dropout or a.attention_dropout) and dataset is train_data:
                mb["dropout_key"] = fold_in(a.seed, iteration, j * dp + dp_rank)
            out.append(mb)
        return out

    dp_rank, losses, skipped, nans, failed = mesh.coord("dp"), [], 0, 0, 0
    stop = {"signal": False}
    if a.exit_signal_handler:
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=True))
    start = tick = time.perf_counter()
    for iteration in range(first_iteration, a.train_iters + 1):
        global_batch = global_batch_size(consumed, gbs, tuple(a.rampup_batch_size) if a.rampup_batch_size else None)
        batch = batches(train_data, consumed, global_batch, iteration)
        data_ms = (time.perf_counter() - tick) * 1e3
        lr, weight_decay = schedule(scheduled), wd_schedule(scheduled)
        decoupled_lr = decoupled_schedule(scheduled) if decoupled_schedule else None
        scale = scaler.scale if scaler else 1.0
        m = train_iteration(state, batch, config=config, layout=layout, mesh=mesh, lr=lr,
                            weight_decay=weight_decay, clip_grad=a.clip_grad,
                            loss_scale=scale, check_overflow=True, overlap_grad_reduce=a.overlap_grad_reduce,
                            bucket_numel=a.ddp_bucket_size, compile=compile_layers, decoupled_lr=decoupled_lr,
                            per_token=a.calculate_per_token_loss)
        consumed += global_batch
        if not m["skipped"]:  # as Megatron's scheduler, the schedules advance only after an update
            scheduled += global_batch if in_samples else 1
        params_norm = float(global_norm(state.params, config, layout, mesh)) if a.log_params_norm else None
        if scaler:
            skipped += int(m["skipped"])
            at_floor = scaler.scale <= scaler.min_scale
            scaler = loss_scale.update(scaler, m["skipped"])
            if m["skipped"] and a.fail_on_nan and (m["loss_non_finite"] or at_floor):  # every rank agrees
                if last_rank:
                    why = "non-finite loss" if m["loss_non_finite"] else \
                        f"the gradient overflowed at the minimum loss scale {scaler.min_scale:g}"
                    print(f"error: iteration {iteration}: {why} (--fail-on-nan); lower the learning rate, or "
                          "train with --bf16", file=sys.stderr)
                failed = 1
                break
        elif m["skipped"]:  # a non-finite gradient without loss scaling: a NaN iteration
            nans += 1
            if a.fail_on_nan:
                if last_rank:
                    print(f"error: iteration {iteration}: non-finite loss or gradient (--fail-on-nan)", file=sys.stderr)
                failed = 1
                break
        now = time.perf_counter()
        elapsed = now - tick
        if last_rank:
            loss, grad_norm = float(m["loss"]), float(m["grad_norm"])  # the step's one read, when logging
            losses.append(loss)
            tflops = model_flops(config, global_batch, a.seq_length) / (elapsed * 1e12 * world)
            emit({"iteration": iteration, "lm_loss": loss, "grad_norm": grad_norm, "lr": lr,
                  "weight_decay": weight_decay, "loss_scale": scale,
                  "skipped": bool(m["skipped"]), "consumed_samples": consumed, "global_batch_size": global_batch,
                  "elapsed_ms": elapsed * 1e3, "tokens_per_s": global_batch * a.seq_length / elapsed,
                  "tflops": tflops, "timers_ms": {"data": data_ms, **m["timers_ms"]},
                  **({"params_norm": params_norm} if a.log_params_norm else {}),
                  **({"decoupled_lr": decoupled_lr} if decoupled_lr is not None else {})})
            if iteration % a.log_interval == 0 or iteration == a.train_iters:
                print(megatron_log_line(iteration=iteration, train_iters=a.train_iters, consumed_samples=consumed,
                                        elapsed_ms=elapsed * 1e3, tflops=tflops, lr=lr,
                                        global_batch_size=global_batch, lm_loss=loss, grad_norm=grad_norm,
                                        loss_scale=scale, params_norm=params_norm, skipped=skipped, nans=nans),
                      flush=True)
                print("    timers (ms): " + " | ".join(f"{k} {v:.1f}" for k, v in records[-1]["timers_ms"].items()),
                      flush=True)
        if a.eval_interval and a.eval_iters and (iteration % a.eval_interval == 0 or iteration == a.train_iters):
            total = torch.zeros(2, dtype=torch.float64)  # [token losses, tokens] over every validation batch
            for _ in range(a.eval_iters):
                pair = evaluate(state.params, batches(valid_data, valid_consumed, gbs, iteration), config=config,
                                layout=layout, mesh=mesh, compile=compile_layers)
                valid_consumed += gbs
                total += pair.cpu() if pair is not None else 0.0
            if last_rank:
                value = float(total[0] / total[1].clamp_min(1.0))
                emit({"iteration": iteration, "validation_lm_loss": value})
                print(f" validation loss at iteration {iteration} | lm loss value: {value:.6E} | lm loss PPL: "
                      f"{math.exp(min(value, 50)):.6E} |", flush=True)
        reason = exit_reason(a, iteration, start, stop["signal"], world, device)
        if a.save and (reason or (a.save_interval and iteration % a.save_interval == 0) or iteration == a.train_iters):
            if not save(iteration):
                failed = 1
                break
        if reason:
            if last_rank:
                print(f"exiting at iteration {iteration}: {reason}", flush=True)
            break
        tick = time.perf_counter()
    if last_rank and losses:
        tail = losses[-10:]
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"done: {len(losses)} iterations, {consumed} samples in {time.perf_counter() - start:.1f} s; lm loss "
              f"{losses[0]:.3f} -> {sum(tail) / len(tail):.3f} (mean of the last {len(tail)}); {skipped} skipped, "
              f"{nans} NaN; peak memory of this process {peak_mb:.0f} MB{gpu_peak(device)}", flush=True)
        if metrics_file:
            metrics_file.close()
            draw_loss_curve(records, Path(a.log_dir) / "loss.png")
        if board:
            board.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return failed


def _gone_peer(e: BaseException) -> bool:
    """Whether a collective failed because another rank stopped (killed, or failed on its own), by the words
    gloo and NCCL use for it; any other error keeps its traceback."""
    return any(words in str(e) for words in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                             "remote process exited"))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        if not _gone_peer(e):
            raise
        said = next(line for line in str(e).splitlines() + [""] if line.strip())[:160]
        print(f"error: rank {os.environ.get('RANK', '0')} lost contact with another rank, which stopped or was "
              f"killed; its output says why ({said})", file=sys.stderr)
        sys.exit(1)
