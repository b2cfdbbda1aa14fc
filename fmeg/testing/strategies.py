"""Hypothesis strategies for property tests of fmeg's models and layouts (needs hypothesis, in the
`test` extra).

    @given(data=st.data())
    def test_mine(data):
        config = data.draw(gpt_configs(kinds=("moe", "mla")))
        layout = data.draw(layouts(config, world=4))      # tp * pp * cp * dp == 4, all valid
        batch = data.draw(batches(config, rows=2))

Everything drawn is small (a model of a few thousand parameters) so that a test runs it on CPU
thread ranks in seconds.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fmeg.models import gpt
from fmeg.parallel.layout import Layout
from fmeg.state.flat import SHARDINGS

KINDS = ("dense", "gqa", "moe", "mla", "mtp")


@st.composite
def gpt_configs(draw, kinds: tuple[str, ...] = KINDS, max_layers: int = 4) -> gpt.GPTConfig:
    """A small GPTConfig of one of kinds: dense (GPT-2's shape: learned positions, LayerNorm,
    biases, tied), gqa (Llama's: RoPE, RMSNorm, SwiGLU, fewer kv heads), moe (gqa with experts),
    mla (DeepSeek's latent attention, YaRN) or mtp (gqa with multi-token prediction)."""
    kind = draw(st.sampled_from(kinds), label="kind")
    heads = draw(st.sampled_from([2, 4]), label="heads")
    head_dim = draw(st.sampled_from([4, 8]), label="head_dim")
    base = dict(
        vocab_size=draw(st.integers(16, 64), label="vocab"),
        max_seq_len=16,
        num_layers=draw(st.integers(1, max_layers), label="layers"),
        hidden_size=heads * head_dim,
        num_heads=heads,
        ffn_hidden_size=draw(st.sampled_from([8, 16, 32]), label="ffn"),
        init_std=0.1,
    )
    # a padded vocabulary splits over any tp up to 8, as Megatron pads it
    base["padded_vocab_size"] = -(-base["vocab_size"] // 8) * 8
    if kind == "dense":
        return gpt.GPTConfig.gpt2(**base)
    base["num_kv_heads"] = draw(st.sampled_from([1, heads // 2]), label="kv_heads")
    if kind == "moe":
        base |= dict(
            num_experts=4,
            moe_router_topk=draw(st.integers(1, 2), label="topk"),
            moe_ffn_hidden_size=8,
            moe_aux_loss_coeff=0.01,
        )
    elif kind == "mla":
        base |= dict(
            multi_latent_attention=True,
            # one key per head
            num_kv_heads=heads,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_head_dim=8,
            qk_pos_emb_head_dim=4,
            v_head_dim=8,
            rope_type="yarn",
            rotary_scaling_factor=4.0,
            original_max_position_embeddings=16,
        )
    elif kind == "mtp":
        base |= dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    return gpt.GPTConfig.llama(**base)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits_over_tp(config: gpt.GPTConfig, tp: int) -> bool:
    try:
        gpt.check_tensor_parallel(config, tp)
    except ValueError:
        return False
    return True


@st.composite
def layouts(draw, config: gpt.GPTConfig, world: int) -> Layout:
    """A Layout of `world` ranks (tp x pp x cp x dp) that config splits over: tp divides its heads,
    MLP and vocabulary, pp (times virtual chunks) its layers, cp its sequence in 2 x cp halves, ep
    its experts and dp; sequence parallelism and the data-parallel sharding drawn too."""
    tp = draw(st.sampled_from([t for t in _divisors(world) if _splits_over_tp(config, t)]))
    pp = draw(st.sampled_from([p for p in _divisors(world // tp) if config.num_layers % p == 0]))
    rest = world // (tp * pp)
    cp = draw(st.sampled_from([c for c in _divisors(rest) if config.max_seq_len % (2 * c) == 0]))
    dp = rest // cp
    interleaved = pp > 1 and config.num_layers % (pp * 2) == 0
    chunks = draw(st.sampled_from([1, 2] if interleaved else [1]), label="chunks")
    experts = config.experts.num_experts if config.experts else 1
    ep = draw(st.sampled_from([e for e in _divisors(dp) if experts % e == 0]))
    return Layout(
        tp=tp,
        pp=pp,
        chunks=chunks,
        dp=dp,
        cp=cp,
        ep=ep,
        # Megatron's rule: experts under tensor parallelism need sequence parallelism
        sequence_parallel=tp > 1 and (experts > 1 or draw(st.booleans(), label="sp")),
        sharding=draw(st.sampled_from(SHARDINGS)) if dp * cp > 1 else "no_shard",
    )


@st.composite
def batches(
    draw,
    config: gpt.GPTConfig,
    rows: int = 2,
    documents: bool | None = None,
    padding: bool | None = None,
) -> dict[str, torch.Tensor]:
    """A microbatch of rows x config.max_seq_len tokens: "tokens" and "labels", with documents
    ("cu_seqlens" per row, padded with the sequence length, and "position_ids" restarting at each
    document) and padding ("loss_mask" zero on a row's tail), each drawn when None."""
    s = config.max_seq_len
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (rows, s + 1), generator=generator)
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:]}
    if documents or documents is None and draw(st.booleans(), label="documents"):
        cuts = [sorted(draw(st.sets(st.integers(1, s - 1), max_size=3))) for _ in range(rows)]
        batch["cu_seqlens"] = torch.tensor([[0, *c, s] + [s] * (s - 1 - len(c)) for c in cuts])
        # each position counted from the start of its document
        starts = [[max([0, *(k for k in c if k <= i)]) for i in range(s)] for c in cuts]
        batch["position_ids"] = torch.arange(s) - torch.tensor(starts)
    if padding or padding is None and draw(st.booleans(), label="padding"):
        kept = draw(st.integers(1, s), label="kept")
        mask = torch.zeros(rows, s)
        mask[:, :kept] = 1.0
        batch["loss_mask"] = mask
    return batch
