"""megatron-core itself, on CPU with gloo, for the Megatron checkpoint tests (run under
torch.distributed.run):

    save ROOT FAMILY TP PP EP ITERATION
        its GPTModel (seed 1234) saved as Megatron-LM's training loop saves one:
        dist_checkpointing.save of {"model": sharded_state_dict(), "args", "iteration", ...} into
        ROOT/iter_NNNNNNN, then the tracker file
    logits DIR FAMILY TOKENS OUT
        one rank: its GPTModel loaded from DIR by dist_checkpointing.load, its logits for the
        [b, s] token tensor in TOKENS written to OUT
    save_legacy ROOT FAMILY TP PP ITERATION
        the same GPTModel saved as Megatron-LM saves --ckpt-format torch: each rank's
        state_dict_for_save_checkpoint() with the args and iteration, torch.save'd into
        ROOT/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt
    train ROOT FAMILY TP PP EP ITERATIONS [SHARDINGS]
        its GPTModel trained ITERATIONS steps by megatron-core's DistributedDataParallel and
        distributed optimizer (Adam, fp32, lr 1e-3, clip 1.0, on batches(i)), saved as
        Megatron-LM saves, the optimizer's state laid out fully_reshardable (as with
        --dist-ckpt-optim-fully-reshardable; the default here) or dp_reshardable (Megatron-LM's
        default), legacy (--ckpt-format torch, with distrib_optim.pt), or several
        ("fully_reshardable,dp_reshardable": ROOT/<sharding>/iter_NNNNNNN each);
        the losses to ROOT/losses.json
    continue DIR FAMILY ITERATIONS OUT [SHARDING]
        one rank: model and optimizer loaded from DIR by megatron-core, each parameter's Adam state
        ({key: tensor} of optimizer.state.*) and the steps written to OUT (its steps taken before
        the ITERATIONS more on the batches after DIR's iteration, whose losses OUT holds too)

FAMILY is one of FAMILIES below: the same models tests/interop/megatron/test_megatron_checkpoint.py
builds in fmeg.
"""

import argparse
import contextlib
import enum
import importlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

FAMILIES = {
    "llama": dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        qk_layernorm=False,
    ),
    "qwen3_moe": dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        qk_layernorm=True,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=48,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    ),
    "gpt2": dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        ffn_hidden_size=256,
        normalization="LayerNorm",
        gated_linear_unit=False,
        add_bias_linear=True,
        qk_layernorm=False,
    ),
}
# Megatron's default flags with experts: biased router
FAMILIES["gpt2_moe"] = dict(
    FAMILIES["gpt2"], num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64
)
# bench/megatron_checkpoint.py's
FAMILIES["llama_bench"] = dict(
    FAMILIES["llama"],
    num_layers=8,
    hidden_size=512,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=1536,
)
VOCAB, SEQ = 128, 32
ARGS = Path(__file__).parent.parent / "fixtures" / "megatron_args"


def model(family: str, tp: int, pp: int, ep: int):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )
    # megatron-core moves its RoPE table to the current CUDA device
    torch.cuda.current_device = lambda: "cpu"
    # its checkpoint writer synchronises before writing
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.transformer.moe import moe_utils

    # its router's matmul names it unset without Transformer Engine
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    try:
        model_parallel_cuda_manual_seed(1234)
    # CPU only: without dropout the CUDA RNG tracker has nothing to fork
    except Exception:
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    f = dict(FAMILIES[family])
    gpt2 = family.startswith("gpt2")
    config = TransformerConfig(
        **f,
        activation_func=F.gelu if gpt2 else F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=True,
        init_method_std=0.05,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=False,
        pipeline_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=f.get("num_moe_experts"),
        qk_layernorm=f["qk_layernorm"],
        normalization=f["normalization"],
    )
    torch.manual_seed(1234)
    m = (
        GPTModel(
            config,
            spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            share_embeddings_and_output_weights=gpt2,
            position_embedding_type="learned_absolute" if gpt2 else "rope",
            rotary_base=10000,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
        )
        .float()
        .eval()
    )
    # norms, biases and expert biases away from their init, so that a misplaced one shows
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias") or "layer_norm" in name:
                p.add_(0.1 * torch.randn(p.shape))
        for name, b in m.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn(b.shape))
    return m


def _decoded(value):
    """A value of tests/fixtures/megatron_args/*.json as Megatron-LM's parser made it: its enums of
    the same classes (one that this megatron-core lacks is made under Megatron's name, so that its
    pickle names the same class)."""
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "dtype" in value:
        return getattr(torch, value["dtype"])
    if "tuple" in value:
        return tuple(_decoded(v) for v in value["tuple"])
    if "dict" in value:
        return {k: _decoded(v) for k, v in value["dict"].items()}
    module_name, qualname = value["enum"].split(":")
    module = importlib.import_module(module_name)
    if not hasattr(module, qualname):
        setattr(
            module,
            qualname,
            enum.Enum(
                qualname,
                {value["name"]: _decoded(value["value"])},
                module=module_name,
                qualname=qualname,
            ),
        )
    cls = getattr(module, qualname)
    # as Megatron-LM's megatron.core.safe_globals registers it
    torch.serialization.add_safe_globals([cls])
    return cls(_decoded(value["value"]))


def megatron_args(family: str, tp: int, pp: int, ep: int, iteration: int) -> argparse.Namespace:
    """The Namespace Megatron-LM's own parser made from the family's launch script (captured in
    tests/fixtures/megatron_args), at this layout and iteration as its training loop leaves it."""
    captured = ARGS / f"{family.removesuffix('_bench')}.json"
    args = argparse.Namespace(
        **{k: _decoded(v) for k, v in json.loads(captured.read_text())["args"].items()}
    )
    for dest in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
    ):
        setattr(args, dest, FAMILIES[family][dest])  # llama_bench: the bench's sizes
    args.kv_channels = args.hidden_size // args.num_attention_heads
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    # the tests' ranks: ep is data parallel
    args.expert_model_parallel_size, args.world_size = (ep, tp * pp * ep)
    args.data_parallel_size = ep
    if os.environ.get("BUCKET_SIZE"):
        args.overlap_grad_reduce, args.ddp_bucket_size = True, int(os.environ["BUCKET_SIZE"])
    args.consumed_train_samples, args.consumed_valid_samples, args.iteration = (
        iteration * 8,
        0,
        iteration,
    )
    return args


def save(root: str, family: str, tp: int, pp: int, ep: int, iteration: int) -> None:
    from megatron.core import dist_checkpointing

    m = model(family, tp, pp, ep)
    directory = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(directory, exist_ok=True)
    state = {
        "model": m.sharded_state_dict(),
        "args": megatron_args(family, tp, pp, ep, iteration),
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
    }
    dist_checkpointing.save(state, directory)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def save_legacy(root: str, family: str, tp: int, pp: int, iteration: int) -> None:
    from megatron.core import parallel_state

    m = model(family, tp, pp, 1)
    t, p = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    # megatron/training/checkpointing.py's get_checkpoint_name
    name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    directory = os.path.join(root, f"iter_{iteration:07d}", name)
    os.makedirs(directory, exist_ok=True)
    state = {
        "model": m.state_dict_for_save_checkpoint(),
        "args": megatron_args(family, tp, pp, 1, iteration),
        "checkpoint_version": 3.0,
        "iteration": iteration,
    }
    torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def logits(directory: str, family: str, tokens_file: str, out_file: str) -> None:
    from megatron.core import dist_checkpointing

    # the classes Megatron-LM's args name, known to torch.load as there
    megatron_args(family, 1, 1, 1, 0)

    m = model(family, 1, 1, 1)
    loaded = dist_checkpointing.load({"model": m.sharded_state_dict()}, directory)
    m.load_state_dict(loaded["model"], strict=False)
    tokens = torch.load(tokens_file, weights_only=True)
    b, s = tokens.shape
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        out = m(tokens, torch.arange(s)[None].expand(b, s), mask)
    torch.save(out, out_file)


LR = 1e-3


def batches(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Iteration i's batch (tokens, labels), [2, SEQ] each: the same for megatron-core and fmeg."""
    gen = torch.Generator().manual_seed(1000 + i)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def trainer(family: str, tp: int, pp: int, ep: int):
    """(model, DDP-wrapped model, distributed optimizer) as Megatron-LM's training builds them."""
    import megatron_cpu  # noqa: F401  (run as a script: its folder is on the path)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    m = model(family, tp, pp, ep).train()
    # BUCKET_SIZE=N: gradients reduced in buckets of N elements as they are ready
    # (--overlap-grad-reduce --ddp-bucket-size N)
    bucket = int(os.environ.get("BUCKET_SIZE", 0)) or None
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=bucket is not None, bucket_size=bucket
    )
    ddp = DistributedDataParallel(m.config, ddp_config, m)
    config = OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=LR, use_distributed_optimizer=True, clip_grad=1.0
    )
    return m, ddp, get_megatron_optimizer(config, [ddp])


def step(ddp, optimizer, i: int) -> float:
    """One training step on batches(i): the mean token loss, as Megatron-LM's loss function."""
    tokens, labels = batches(i)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    s = tokens.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    losses = ddp(tokens, torch.arange(s)[None].expand_as(tokens), mask, labels=labels)
    loss = losses.float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    optimizer.step()
    return loss.item()


def sharded(m, optimizer, is_loading: bool = False, sharding: str = "fully_reshardable") -> dict:
    """The checkpoint's state dict as Megatron-LM's save (and load) builds it (unwrapped model),
    the distributed optimizer's state laid out as `sharding` says (fully_reshardable as with
    --dist-ckpt-optim-fully-reshardable, dp_reshardable as by default)."""
    model_sd = m.sharded_state_dict()
    state = {"model": model_sd}
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": sharding}
    )
    return state


def train(
    root: str, family: str, tp: int, pp: int, ep: int, iterations: int, shardings: str
) -> None:
    """Train `iterations` steps and save as Megatron-LM does, the optimizer's state laid out as
    each of the comma-separated `shardings` says: one in ROOT, several in ROOT/<sharding> each."""
    from megatron.core import dist_checkpointing

    m, ddp, optimizer = trainer(family, tp, pp, ep)
    losses = [step(ddp, optimizer, i) for i in range(iterations)]
    names = shardings.split(",")
    for sharding in names:
        top = root if len(names) == 1 else os.path.join(root, sharding)
        directory = os.path.join(top, f"iter_{iterations:07d}")
        os.makedirs(directory, exist_ok=True)
        if sharding == "legacy":
            _save_trained_legacy(directory, m, optimizer, family, tp, pp, iterations)
            if dist.get_rank() == 0:
                with open(os.path.join(top, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(str(iterations))
            continue
        state = sharded(m, optimizer, sharding=sharding)
        state.update(
            args=megatron_args(family, tp, pp, ep, iterations),
            checkpoint_version=3.0,
            iteration=iterations,
            num_floating_point_operations_so_far=0,
        )
        # what Megatron-LM's save_checkpoint records beside it
        content = {"distrib_optim_sharding_type": sharding}
        dist_checkpointing.save(state, directory, content_metadata=content)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(top, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iterations))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "losses.json"), "w") as f:
            json.dump(losses, f)


def _save_trained_legacy(directory, m, optimizer, family, tp, pp, iterations) -> None:
    """As Megatron-LM's --ckpt-format torch saves a distributed-optimizer run: each model-parallel
    rank's model_optim_rng.pt (its model, the optimizer's state dict, args, iteration) written by
    data-parallel rank 0, and beside it distrib_optim.pt, the parameter state gathered there."""
    from megatron.core import parallel_state

    t = parallel_state.get_tensor_model_parallel_rank()
    p = parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    os.makedirs(os.path.join(directory, name), exist_ok=True)
    first = parallel_state.get_data_parallel_rank() == 0
    state = {
        "model": m.state_dict_for_save_checkpoint(),
        "optimizer": optimizer.state_dict(),
        "args": megatron_args(family, tp, pp, 1, iterations),
        "checkpoint_version": 3.0,
        "iteration": iterations,
    }
    if first:
        torch.save(state, os.path.join(directory, name, "model_optim_rng.pt"))
    optimizer.save_parameter_state(os.path.join(directory, name, "distrib_optim.pt"))
    dist.barrier()


def continue_(
    directory: str, family: str, iterations: str, out: str, sharding: str = "fully_reshardable"
) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    megatron_args(family, 1, 1, 1, 0)
    m, ddp, optimizer = trainer(family, 1, 1, 1)
    # torch's Adam keeps no state before its first step, which the distributed optimizer's
    # state_dict needs without Apex or TE: the state a step would start from
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                inner.optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
    loaded = dist_checkpointing.load(sharded(m, optimizer, True, sharding), directory)
    m.load_state_dict(loaded["model"], strict=False)
    optimizer.load_state_dict(loaded["optimizer"])
    # without Apex or TE its load gives every parameter the same step tensor, which torch's Adam
    # then advances once per parameter: each its own, as a run that never stopped has
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for st in inner.optimizer.state.values():
            st["step"] = st["step"].clone()
    state = sharded(m, optimizer)["optimizer"]["param_state"]
    # {key: the whole tensor}: the layers' pieces stacked as the checkpoint holds them
    moments: dict[str, torch.Tensor] = {}
    for group in state.values():
        for t in group.values() if isinstance(group, dict) else [group]:
            if not isinstance(t, ShardedTensor):
                continue
            whole = moments.setdefault(t.key, torch.zeros(t.global_shape))
            # the stacked layers' axes come first, one index each
            stacked = len(t.global_offset) - len(t.local_shape)
            box = tuple(t.global_offset[:stacked]) + tuple(
                slice(o, o + n) for o, n in zip(t.global_offset[stacked:], t.local_shape)
            )
            whole[box] = t.data.detach()
    start = int(loaded.get("iteration", 0))
    steps = {
        float(st["step"])
        for inner in getattr(optimizer, "chained_optimizers", [optimizer])
        for st in inner.optimizer.state.values()
    }
    losses = [step(ddp, optimizer, start + i) for i in range(int(iterations))]
    torch.save({"moments": moments, "losses": losses, "steps": sorted(steps)}, out)


def main() -> None:
    dist.init_process_group("gloo")
    mode, *rest = sys.argv[1:]
    if mode == "save":
        root, family, tp, pp, ep, iteration = rest
        save(root, family, int(tp), int(pp), int(ep), int(iteration))
    elif mode == "save_legacy":
        root, family, tp, pp, iteration = rest
        save_legacy(root, family, int(tp), int(pp), int(iteration))
    elif mode == "train":
        root, family, tp, pp, ep, iterations, *sharding = rest
        sharding = sharding[0] if sharding else "fully_reshardable"
        train(root, family, int(tp), int(pp), int(ep), int(iterations), sharding)
    elif mode == "continue":
        continue_(*rest)
    else:
        logits(*rest)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
