"""Per-rank programs for the parallel property tests (module level, so gloo processes can import
them).

Each program takes the mesh and the *full* inputs, takes this rank's shard itself, and returns its
forward output, its vjp for the given cotangent, its jvp for the given tangent and a vmap over a
leading batch, so one program checks all four rules of every collective it uses.
"""

from __future__ import annotations

import threading

import torch

from fmeg.parallel import collectives as C
from fmeg.parallel.tensor import (
    TensorParallel,
    column_parallel_linear,
    row_parallel_linear,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)


def _chunk(x, mesh, dim):
    return x.chunk(mesh.size("tp"), dim=dim)[mesh.coord("tp")]


def _rules(fn, x, cotangent, tangent, batch):
    out, vjp = torch.func.vjp(fn, x)
    # Forward-mode AD levels are process-global in PyTorch, so ranks that are threads cannot run jvp
    # at once; jvp is checked on gloo ranks (one process each).
    in_thread = threading.current_thread() is not threading.main_thread()
    jvp_out = None if in_thread else torch.func.jvp(fn, (x,), (tangent,))[1]
    return {
        "out": out,
        "grad": vjp(cotangent)[0],
        "jvp": jvp_out,
        "vmap": torch.func.vmap(fn)(batch),
    }


def copy_then_reduce(mesh, x, w, cot, tan, batch):
    """y = reduce_from(tanh(copy_to(x) * w_r)): x replicated in and out. Reference: sum_r tanh(x *
    w_r)."""
    g, wr = mesh.group("tp"), w[mesh.coord("tp")]
    return _rules(lambda x: C.reduce_from(torch.tanh(C.copy_to(x, g) * wr), g), x, cot, tan, batch)


def scatter_then_gather(mesh, x, w, dim, cot, tan, batch):
    """y = gather_from(tanh(scatter_to(x) * w_chunk)): elementwise on chunks. Reference: tanh(x *
    w)."""
    g, wr = mesh.group("tp"), _chunk(w, mesh, dim)
    return _rules(
        lambda x: C.gather_from(torch.tanh(C.scatter_to(x, g, dim) * wr), g, dim),
        x,
        cot,
        tan,
        batch,
    )


def sequence_parallel_region(mesh, x, w, dim, cot, tan, batch):
    """x sharded along dim -> gather -> rank-local partial tanh(x * w_r) -> reduce-scatter along
    dim. Reference: chunk_r(sum_r tanh(x * w_r))."""
    g, wr = mesh.group("tp"), w[mesh.coord("tp")]
    shard = lambda t, d=dim: _chunk(t, mesh, d)  # noqa: E731
    fn = lambda x: C.reduce_scatter_to(torch.tanh(C.gather_from_sp(x, g, dim) * wr), g, dim)
    return _rules(fn, shard(x), shard(cot), shard(tan), _chunk(batch, mesh, dim + 1))


def all_to_all_reshard(mesh, x, split_dim, cat_dim, cot, tan, batch):
    """x sharded along cat_dim -> tanh -> all_to_all -> sharded along split_dim. Reference:
    tanh(x)."""
    g = mesh.group("tp")
    fn = lambda x: C.all_to_all(torch.tanh(x), g, split_dim, cat_dim)  # noqa: E731
    return _rules(
        fn,
        _chunk(x, mesh, cat_dim),
        _chunk(cot, mesh, split_dim),
        _chunk(tan, mesh, cat_dim),
        _chunk(batch, mesh, cat_dim + 1),
    )


def all_to_all_rows_exchange(mesh, x, counts, cot, tan, batch):
    """Rank i's rows (its block of x) -> tanh -> counts[i][j] rows to rank j. Inputs are the full
    tensors in rank order: x, tan and batch (rows along its dim 1) by what each rank sends, cot by
    what each receives."""
    g, me = mesh.group("tp"), mesh.coord("tp")
    send, recv = counts[me], [row[me] for row in counts]
    sent, received = [sum(row) for row in counts], [sum(col) for col in zip(*counts)]
    mine = lambda t, sizes, dim=0: t.split(sizes, dim=dim)[me]  # noqa: E731
    fn = lambda x: C.all_to_all_rows(torch.tanh(x), g, send, recv)  # noqa: E731
    return _rules(fn, mine(x, sent), mine(cot, received), mine(tan, sent), mine(batch, sent, 1))


def parallel_mlp(mesh, x, params, sp):
    """column_parallel_linear -> gelu -> row_parallel_linear, loss and grads of x and every
    parameter."""
    tp = TensorParallel(mesh.group("tp"), sp)
    w1, b1, w2, b2 = params
    local = (_chunk(w1, mesh, 0), _chunk(b1, mesh, 0), _chunk(w2, mesh, 1), b2)
    x_in = _chunk(x, mesh, 1) if sp else x

    def loss(x, p):
        h = torch.nn.functional.gelu(column_parallel_linear(x, p[0], p[1], tp))
        y = row_parallel_linear(h, p[2], p[3], tp)
        return y, (y**2).sum()

    # Under SP each rank's loss covers its sequence chunk; the gradients are those of their sum.
    y, _ = loss(x_in, local)
    grads = torch.func.grad(lambda x, p: loss(x, p)[1], argnums=(0, 1))(x_in, local)
    return {"out": y, "grad_x": grads[0], "grad_p": grads[1]}


def parallel_embedding(mesh, ids, table, weights, sp):
    """Output, and the gradient of sum(out * weights) (under SP, of the sum over the ranks'
    chunks)."""
    tp = TensorParallel(mesh.group("tp"), sp)
    local, w = _chunk(table, mesh, 0), _chunk(weights, mesh, 1) if sp else weights
    out = vocab_parallel_embedding(ids, local, tp)
    grad = torch.func.grad(lambda t: (vocab_parallel_embedding(ids, t, tp) * w).sum())(local)
    return {"out": out, "grad": grad}


def parallel_cross_entropy(mesh, logits, labels, smoothing, cot, tan, batch, vocab_size=None):
    tp = TensorParallel(mesh.group("tp"))
    fn = lambda lg: vocab_parallel_cross_entropy(
        lg,
        labels,
        tp,
        label_smoothing=smoothing,  # noqa: E731
        vocab_size=vocab_size,
    )
    return _rules(fn, _chunk(logits, mesh, -1), cot, _chunk(tan, mesh, -1), _chunk(batch, mesh, -1))


def recorded_layer_volume(mesh, params, x, config, sp):
    """Bytes each collective moves in one forward+backward of one transformer layer."""
    from fmeg.models import gpt
    from fmeg.parallel.comm import RecordingGroup

    from fmeg.parallel.sharding import shard

    group = RecordingGroup(mesh.group("tp"))
    tp = TensorParallel(group, sp)
    layer_rules = [
        (pat.removeprefix("layers.*."), part)
        for pat, part in gpt.TP_RULES
        if pat.startswith("layers")
    ]
    local = shard(params, layer_rules, {"tp": (mesh.coord("tp"), mesh.size("tp"))})
    x_in = _chunk(x, mesh, 1) if sp else x
    torch.func.grad(lambda p, x: gpt.layer(p, x, config, tp=tp).sum(), argnums=(0, 1))(local, x_in)
    return group.log


def megatron_vocab_parallel_cross_entropy(mesh, logits, labels):
    """megatron-core's vocab_parallel_cross_entropy on this rank's shard (needs its
    parallel_state)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_ce

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=mesh.size("tp"))
    return megatron_ce(_chunk(logits, mesh, -1).clone(), labels)


def gpt_loss_and_grads(mesh, params, batch, config, key):
    """Shard the full params for this rank, then the loss and its gradients under TP (SP from the
    mesh); with multi-token prediction layers, the objective's gradients (fmeg.models.mtp.loss)."""
    from fmeg.models import gpt, mtp
    from fmeg.parallel.sharding import shard

    tp = TensorParallel(mesh.group("tp"), mesh.sequence_parallel)
    local = shard(params, gpt.TP_RULES, {"tp": (mesh.coord("tp"), mesh.size("tp"))})
    grads, loss = torch.func.grad_and_value(lambda p: mtp.loss(p, batch, config, key=key, tp=tp))(
        local
    )
    return loss, grads


def pipelined_gpt(
    mesh, params, microbatches, config, schedule_name, vp, segmented=True, stage_layers=None
):
    """Split the GPT into stages, run this rank's part of a schedule, sum tied-embedding grads.
    Stages run as chains of segments (one vjp each, as training does) or, segmented=False, as one
    function; stage_layers: each stage's decoder layers (None: even)."""
    from fmeg.models import gpt_pipeline as gp
    from fmeg.parallel.pipeline import execute, schedules
    from fmeg.parallel.pipeline.actions import placement_of

    pp, rank = mesh.size("pp"), mesh.coord("pp")
    m = len(microbatches)
    make = {
        "gpipe": lambda: schedules.gpipe(pp, m),
        "1f1b": lambda: schedules.one_f_one_b(pp, m),
        "interleaved": lambda: schedules.interleaved_1f1b(pp, m, vp),
        "zero_bubble": lambda: schedules.zero_bubble_h1(pp, m),
        "zero_bubble_v": lambda: schedules.zero_bubble_v(pp, m),
        "dualpipe_v": lambda: schedules.dualpipe_v(pp, m),
    }[schedule_name]
    schedule = schedules.with_communication(make())
    placement = placement_of(schedule)
    stages = stage_layers or pp * vp
    mine = [s for s in range(pp * vp) if placement[s] == rank]
    all_params = gp.split(params, config, stages)
    stage_params = {s: all_params[s] for s in mine}
    fns = {s: (gp.stage_segments if segmented else gp.stage_fn)(config, s, stages) for s in mine}
    loss, grads = execute.execute(
        schedule[rank],
        fns,
        stage_params,
        microbatches,
        mesh.group("pp"),
        pp * vp,
        placement=placement,
    )
    grads = gp.sync_tied_embedding_grads(grads, config, stages, mesh.group("embedding"))
    return loss, grads


def zero_state_bytes(mesh, config, compute_dtype):
    """Optimizer-state bytes on this rank with ZeRO-1, and the parameter count it covers."""
    from fmeg import tree
    from fmeg.models import gpt
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import init_state, shard_params

    layout = Layout(dp=mesh.size("dp"), sharding="optim")
    params = shard_params(gpt.init(config, 0), config, layout, mesh)
    state = init_state(params, config, layout, mesh, compute_dtype=compute_dtype)
    state_bytes = sum(x.numel() * x.element_size() for x in tree.tree_leaves(state.opt_state))
    return (
        state_bytes - 8,
        tree.num_params(params),
        state.flat.padded,
        tree.tree_leaves(state.params)[0].dtype,
        state.bytes_per_parameter(),
    )


UNITS = {"leaf": lambda path: path, "stage": lambda path: path.split(".")[0]}


def grad_sync_mean(
    mesh,
    grads_per_rank,
    owner_slices,
    replicated,
    bucket_numel,
    order,
    buffer_dtype=None,
    units="leaf",
):
    """GradSync over the dp group: leaves handed over in `order` (stage, path) pairs, into a buffer
    of buffer_dtype if given, ZeRO's units each leaf or each stage (UNITS); returns (the tree of
    means (ZeRO: only the replicated leaves are whole), this rank's owned elements, collectives,
    pending leaves at each bucket start)."""
    from fmeg import tree
    from fmeg.parallel.comm import RecordingGroup
    from fmeg.parallel.data_parallel import GradSync
    from fmeg.parallel.zero import FlatBuffer

    group = RecordingGroup(mesh.group("dp"))
    mine = grads_per_rank[mesh.coord("dp")]
    unit_of = UNITS[units] if owner_slices else None
    padded = FlatBuffer.of(mine, mesh.size("dp"), unit_of).padded
    buffer = None if buffer_dtype is None else torch.zeros(padded, dtype=buffer_dtype)
    sync = GradSync(
        mine,
        group,
        owner_slices=owner_slices,
        replicated=frozenset(replicated),
        bucket_numel=bucket_numel,
        buffer=buffer,
        unit_of=unit_of,
    )
    flat = {s: tree.flatten(g) for s, g in mine.items()}
    for stage, path in order:
        sync.ready(stage, {path: flat[stage][path]})
    sync.finish()
    return (
        tree.tree_map(torch.clone, sync.tree()),
        sync.owned().clone(),
        [op for op, _ in group.log],
        sync.started_with_pending,
    )


def compiled_training(
    mesh,
    config,
    layout_kwargs,
    microbatches,
    iterations,
    compile,
    dtype=torch.float32,
    overlap=False,
):
    """`iterations` training steps (train_iteration, AdamW, clipping) with every segment compiled by
    the backend `compile`, or eager (None), with or without the data-parallel overlap (small
    buckets); returns (losses, grad norms, dynamo's graph count after each iteration, graph breaks).
    Graph counts are per process, so each program runs on fresh gloo ranks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fmeg.models import gpt
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import init_state, shard_params, train_iteration
    from fmeg.training.step_settings import StepSettings

    torch._dynamo.reset()
    counters.clear()
    layout = Layout(
        tp=mesh.size("tp"),
        pp=mesh.size("pp"),
        dp=mesh.size("dp"),
        sequence_parallel=mesh.sequence_parallel,
        **layout_kwargs,
    )
    params = shard_params(gpt.init(config, 0), config, layout, mesh)
    state = init_state(params, config, layout, mesh, compute_dtype=dtype)
    losses, norms, graphs = [], [], []
    dp, dp_rank = mesh.size("dp"), mesh.coord("dp")
    for _ in range(iterations):
        mine = microbatches[dp_rank::dp]
        m = train_iteration(
            state,
            mine,
            config=config,
            layout=layout,
            mesh=mesh,
            settings=StepSettings(
                lr=1e-2,
                weight_decay=0.01,
                clip_grad=1.0,
                compile=compile,
                overlap_grad_reduce=overlap,
                bucket_numel=2000 if overlap else None,
            ),
        )
        losses.append(None if m["loss"] is None else float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        graphs.append(counters["stats"]["unique_graphs"])
    return losses, norms, graphs, dict(counters["graph_break"])


def generation(mesh, config, seed, prompts, max_new_tokens, sampling, seeds):
    """This rank's part of generate() on the mesh's tp x pp layout: (tokens, logprobs), the same on
    every rank."""
    from fmeg.inference import generate
    from fmeg.models import gpt
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import shard_params

    layout = Layout(tp=mesh.size("tp"), pp=mesh.size("pp"))
    params = shard_params(gpt.init(config, seed), config, layout, mesh)[mesh.coord("pp")]
    out = generate(
        params,
        prompts,
        config,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seeds,
        tp=TensorParallel(mesh.group("tp")),
        pp_group=mesh.group("pp"),
    )
    return out.tokens, out.logprobs


def megatron_gpt_logits(mesh, params, tokens, config):
    """megatron-core's GPTModel (local spec, on CPU) holding fmeg's parameters: its logits [b, s, V]
    for tokens. One rank; parallel_state is initialised for it."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fmeg import tree

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    # megatron-core's RoPE moves its table to the current CUDA device
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # (this worker process only)
    try:
        model_parallel_cuda_manual_seed(0)
    # CPU only: without dropout, the CUDA RNG tracker has nothing to fork
    except Exception:
        import contextlib

        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    c = config
    tc = TransformerConfig(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        num_query_groups=c.num_kv_heads,
        ffn_hidden_size=c.ffn_hidden_size,
        kv_channels=c.head_dim,
        normalization="RMSNorm" if c.norm == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=c.norm_eps,
        gated_linear_unit=c.activation == "swiglu",
        activation_func=F.silu,
        add_bias_linear=c.bias,
        add_qkv_bias=c.attention.qkv_bias,
        qk_layernorm=c.attention.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    model = (
        GPTModel(
            tc,
            get_gpt_layer_local_spec(
                qk_layernorm=c.attention.qk_norm, normalization=tc.normalization
            ),
            vocab_size=c.padded_vocab_size,
            max_sequence_length=c.max_seq_len,
            share_embeddings_and_output_weights=c.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(c.rope.theta),
            rope_scaling=c.rope.scaling is not None,
            rope_scaling_factor=c.rope.scaling[0] if c.rope.scaling else 8.0,
        )
        .float()
        .eval()
    )
    flat = tree.flatten(params)
    state = {
        "embedding.word_embeddings.weight": flat["embedding.word.weight"],
        "decoder.final_layernorm.weight": flat["final_norm.weight"],
    }
    if not c.tie_embeddings:
        state["output_layer.weight"] = flat["output.weight"]
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}", f"decoder.layers.{i}"
        state |= {
            f"{theirs}.input_layernorm.weight": flat[f"{ours}.attn_norm.weight"],
            f"{theirs}.self_attention.linear_qkv.weight": flat[f"{ours}.attn.qkv.weight"],
            f"{theirs}.self_attention.linear_proj.weight": flat[f"{ours}.attn.proj.weight"],
            f"{theirs}.pre_mlp_layernorm.weight": flat[f"{ours}.mlp_norm.weight"],
            f"{theirs}.mlp.linear_fc1.weight": flat[f"{ours}.mlp.fc1.weight"].reshape(
                -1, c.hidden_size
            ),
            f"{theirs}.mlp.linear_fc2.weight": flat[f"{ours}.mlp.fc2.weight"],
        }
        if c.attention.qkv_bias:
            state[f"{theirs}.self_attention.linear_qkv.bias"] = flat[f"{ours}.attn.qkv.bias"]
        if c.attention.qk_norm:
            state[f"{theirs}.self_attention.q_layernorm.weight"] = flat[
                f"{ours}.attn.q_norm.weight"
            ]
            state[f"{theirs}.self_attention.k_layernorm.weight"] = flat[
                f"{ours}.attn.k_norm.weight"
            ]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("_extra_state" in m for m in missing), (missing, unexpected)
    b, s = tokens.shape
    position_ids = torch.arange(s)[None].expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        return model(tokens, position_ids, mask)


def expert_parallel_loss_and_grads(mesh, params, batches, config, ep):
    """Expert parallelism over the world (each rank its own batch: ep ranks are data-parallel
    ranks), tensor parallelism with sequence parallelism inside each ep rank when mesh's tp > 1:
    this rank's loss and the gradients of its shards (those of its own loss for dense leaves; of
    every ep rank's loss for its experts)."""
    from fmeg.models import gpt, moe
    from fmeg.parallel.sharding import shard
    from fmeg.parallel.tensor import ExpertParallel

    ep_rank = mesh.coord("ep")
    experts = ExpertParallel(mesh.group("tp_ep"), ep_rank, ep)
    tp = TensorParallel(mesh.group("tp"), mesh.sequence_parallel, experts)
    local = shard(
        params,
        gpt.TP_RULES + moe.EP_RULES,
        {"tp": (mesh.coord("tp"), mesh.size("tp")), "ep": (ep_rank, ep)},
    )
    batch = batches[ep_rank]
    grads, loss = torch.func.grad_and_value(lambda p: gpt.loss(p, batch, config, tp=tp))(local)
    return loss, grads, {"tp": (mesh.coord("tp"), mesh.size("tp")), "ep": (ep_rank, ep)}


def context_attention(mesh, q, k, v, dout, comm_type, dropout, documents=None):
    """Context parallelism over every rank (tp 1): this rank's tokens of q, k, v and dout (the 2 x
    cp chunk order) -> its rows of the attention and its gradients of q, k and v (documents:
    cu_seqlens of packed documents)."""
    from fmeg.parallel.context import AttentionDropout, ContextParallel, attention, shard_sequence

    cp = ContextParallel(mesh.group("cp"), comm_type, mesh.group("cp_a2a"), mesh.group("cp_p2p"))
    mine = [shard_sequence(t, cp, dim=2) for t in (q, k, v, dout)]
    drop = None if dropout == 0 else AttentionDropout(dropout, 7, 0, q.shape[1])
    fn = lambda q, k, v: attention(q, k, v, cp, drop, documents)  # noqa: E731
    out, vjp = torch.func.vjp(fn, *mine[:3])
    # vmap over a leading dimension (q batched, k and v shared): without dropout, whose mask is
    # keyed by batch row
    vmapped = (
        torch.func.vmap(fn, in_dims=(0, None, None))(
            torch.stack([mine[0], 2 * mine[0]]), *mine[1:3]
        )
        if dropout == 0
        else None
    )
    return {"out": out, "grads": vjp(mine[3]), "vmap": vmapped}


def context_parallel_gpt(mesh, params, batch, config, key, comm_type):
    """The GPT loss and gradients of this rank's tokens (its cp chunks), tensor (and sequence)
    parallel inside each cp rank: the cp ranks' losses and gradients sum to the microbatch's."""
    from fmeg.models import gpt
    from fmeg.parallel.context import ContextParallel, shard_batch
    from fmeg.parallel.sharding import shard

    cp = ContextParallel(mesh.group("cp"), comm_type, mesh.group("cp_a2a"), mesh.group("cp_p2p"))
    tp = TensorParallel(mesh.group("tp"), mesh.sequence_parallel, context=cp)
    local = shard(params, gpt.TP_RULES, {"tp": (mesh.coord("tp"), mesh.size("tp"))})
    mine = shard_batch(batch, cp)
    grads, loss = torch.func.grad_and_value(lambda p: gpt.loss(p, mine, config, key=key, tp=tp))(
        local
    )
    return loss, grads, (mesh.coord("tp"), mesh.coord("cp"))


def compiled_context_parallel_gpt(mesh, params, batch, config, key, comm_type, backend):
    """context_parallel_gpt with the loss torch.compile'd as one graph (fullgraph, by `backend`):
    the loss, its gradients by autograd, and dynamo's graph count and graph breaks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fmeg import tree
    from fmeg.models import gpt
    from fmeg.parallel.context import ContextParallel, shard_batch
    from fmeg.parallel.sharding import shard

    torch._dynamo.reset()
    counters.clear()
    cp = ContextParallel(mesh.group("cp"), comm_type, mesh.group("cp_a2a"), mesh.group("cp_p2p"))
    tp = TensorParallel(mesh.group("tp"), mesh.sequence_parallel, context=cp)
    flat = {
        path: t.detach().requires_grad_()
        for path, t in tree.flatten(
            shard(params, gpt.TP_RULES, {"tp": (mesh.coord("tp"), mesh.size("tp"))})
        ).items()
    }
    mine = shard_batch(batch, cp)
    compiled = torch.compile(
        lambda p, b, k: gpt.loss(p, b, config, key=k, tp=tp), backend=backend, fullgraph=True
    )
    loss = compiled(tree.unflatten(flat), mine, torch.tensor(key))
    grads = tree.unflatten(dict(zip(flat, torch.autograd.grad(loss, list(flat.values())))))
    return (
        loss.detach(),
        grads,
        (mesh.coord("tp"), mesh.coord("cp")),
        counters["stats"]["unique_graphs"],
        dict(counters["graph_break"]),
    )


def global_balance_loss_parts(mesh, logits_per_rank, config):
    """Each data rank's part of global_aux_loss over a step of microbatches
    (logits_per_rank[rank][j]: its microbatch j's [b, s, E] router logits), counting every rank's
    tokens (the balance group: dp here)."""
    from fmeg.models import moe
    from fmeg.parallel.tensor import ExpertParallel

    tp = TensorParallel(experts=ExpertParallel(balance_group=mesh.group("dp")))
    mine = logits_per_rank[mesh.coord("dp")]
    m = len(mine)
    buffer = torch.zeros(m, 1, config.experts.num_experts)
    order = torch.arange(m)
    parts = []
    for j, logits in enumerate(mine):
        aux = moe.AuxLosses(
            global_counts=buffer, one_hot=(order == j).float(), seen=(order <= j).float()
        )
        parts.append(moe.balance_losses(logits, config, tp, aux, 0)["global_load_balancing_loss"])
    return torch.stack(parts)


def sharded_training(
    mesh,
    config,
    layout_kwargs,
    microbatches,
    iterations,
    dtype=torch.float32,
    overlap=False,
    eval_after=False,
    state_options=None,
):
    """`iterations` steps at the mesh's layout with layout_kwargs (a sharding among them), each
    data-parallel rank taking its microbatches of the global batch; returns (losses, grad norms,
    persistent bytes per parameter, validation [loss sum, tokens] after training or None)."""
    from fmeg.models import gpt
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import evaluate, init_state, shard_params, train_iteration
    from fmeg.training.step_settings import StepSettings

    layout = Layout(
        tp=mesh.size("tp"),
        pp=mesh.size("pp"),
        dp=mesh.size("dp"),
        sequence_parallel=mesh.sequence_parallel,
        **layout_kwargs,
    )
    params = shard_params(gpt.init(config, 0), config, layout, mesh)
    state = init_state(params, config, layout, mesh, compute_dtype=dtype, **(state_options or {}))
    losses, norms = [], []
    dp, dp_rank = mesh.size("dp"), mesh.coord("dp")
    for _ in range(iterations):
        m = train_iteration(
            state,
            microbatches[dp_rank::dp],
            config=config,
            layout=layout,
            mesh=mesh,
            settings=StepSettings(
                lr=1e-2,
                weight_decay=0.01,
                clip_grad=1.0,
                overlap_grad_reduce=overlap,
                bucket_numel=500 if overlap else None,
            ),
        )
        losses.append(None if m["loss"] is None else float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    pair = (
        evaluate(
            state.params,
            microbatches[dp_rank::dp],
            config=config,
            layout=layout,
            mesh=mesh,
            use=state.use,
        )
        if eval_after
        else None
    )
    return losses, norms, state.bytes_per_parameter(), None if pair is None else pair.tolist()


def sharded_grad_sync_mean(mesh, grads_per_rank, replicated, units, order, microbatches):
    """ShardedGradSync over the dp group, its units each leaf or each stage (UNITS): each
    microbatch hands this rank's gradients (divided by microbatches) over leaf by leaf in `order`;
    returns (this rank's owned elements, the replicated leaves' owned elements by leaf())."""
    from fmeg import tree
    from fmeg.parallel.sharded_grads import ShardedGradSync
    from fmeg.parallel.zero import FlatBuffer

    group = mesh.group("dp")
    mine = grads_per_rank[mesh.coord("dp")]
    layout = FlatBuffer.of(mine, mesh.size("dp"), UNITS[units])
    acc = torch.full((layout.padded // mesh.size("dp"),), float("nan"), dtype=torch.float64)
    sync = ShardedGradSync(mine, group, acc, unit_of=UNITS[units], replicated=frozenset(replicated))
    flat = {s: tree.flatten(g) for s, g in mine.items()}
    for _ in range(2):  # a second iteration starts from nothing
        sync.reset()
        for m in range(microbatches):
            for stage, path in order:
                sync.add(
                    stage, {path: flat[stage][path] / microbatches}, final=m == microbatches - 1
                )
        sync.finish()
        tied = {p: sync.leaf(p).clone() for p in replicated}
    return acc.clone(), tied


def fsdp_on_the_wire(mesh, config, sharding, microbatches, iterations, policy="true"):
    """`iterations` steps at dp with `sharding`, the data-parallel group (dp_cp_shard) recorded;
    returns ([(collective, bytes)] of the last iteration, {unit: its padded elements},
    the dtype's bytes)."""
    from fmeg.parallel.comm import RecordingGroup
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import init_state, shard_params, train_iteration
    from fmeg.training.step_settings import StepSettings
    from fmeg.models import gpt
    from fmeg.state.flat import unit_of

    recorded = RecordingGroup(mesh.comms["dp_cp_shard"])
    mesh.comms["dp_cp_shard"] = recorded
    layout = Layout(dp=mesh.size("dp"), sharding=sharding)
    params = shard_params(gpt.init(config, 0), config, layout, mesh)
    state = init_state(params, config, layout, mesh, reshard_after_forward=policy)
    dp, dp_rank = mesh.size("dp"), mesh.coord("dp")
    for _ in range(iterations):
        recorded.log.clear()
        train_iteration(
            state,
            microbatches[dp_rank::dp],
            config=config,
            layout=layout,
            mesh=mesh,
            settings=StepSettings(lr=1e-2, weight_decay=0.01, clip_grad=1.0),
        )
    names = list(dict.fromkeys(unit_of(path) for path in state._where))
    units = {name: b - a for name, (a, b) in zip(names, state.flat.units)}
    return list(recorded.log), units, state.weights.element_size()
