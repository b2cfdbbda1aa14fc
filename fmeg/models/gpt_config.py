"""GPTConfig: a GPT's shape, and its variants as a tree of groups (fmeg.models.config_groups):
attention (GQA or MLA, sinks, windows), rope (None: learned positions; Llama 3.1's or YaRN's
frequencies), mlp (the gated MLP's extras), experts (None: dense; with their router) and mtp.

    config = GPTConfig.llama(num_layers=4)                  # presets, overridden by keyword
    config = GPTConfig.llama(num_experts=8, moe_router_topk=2)   # Megatron's flat names still work
    config.experts.router.topk, config.rope.theta           # read from the tree
    config.replace(num_layers=8)                            # a copy with changes
    GPTConfig(**config.flat())                              # the flat form checkpoints store

Every field is plain data; a field that makes no sense, or a setting of a group the model does not
have, raises ValueError naming it by its flat name. The model itself is fmeg.models.gpt.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from fmeg.models.config_rules import POSITIONS, need, validate
from fmeg.models.config_groups import MLA, MLP, MTP, Attention, Experts, RoPE, Router, YaRN


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


# Today's flat keywords (Megatron's flag names, and what checkpoints store) -> (group, field).
FLAT: dict[str, tuple[str, str]] = {
    "kv_channels": ("attention", "kv_channels"),
    "qk_norm": ("attention", "qk_norm"),
    "qkv_bias": ("attention", "qkv_bias"),
    "attention_dropout": ("attention", "dropout"),
    "softmax_type": ("attention", "softmax_type"),
    "window_size": ("attention", "window_size"),
    "window_attn_skip_freq": ("attention", "window_attn_skip_freq"),
    **{name: ("attention.mla", name) for name in _names(MLA)},
    "rope_theta": ("rope", "theta"),
    "rotary_percent": ("rope", "percent"),
    "rope_scaling": ("rope", "scaling"),
    "rope_type": ("rope", "kind"),
    "rotary_scaling_factor": ("rope.yarn", "factor"),
    "original_max_position_embeddings": ("rope.yarn", "original_max_position_embeddings"),
    "beta_fast": ("rope.yarn", "beta_fast"),
    "beta_slow": ("rope.yarn", "beta_slow"),
    "mscale": ("rope.yarn", "mscale"),
    "mscale_all_dim": ("rope.yarn", "mscale_all_dim"),
    "yarn_round_to_int": ("rope.yarn", "round_to_int"),
    "glu_linear_offset": ("mlp", "glu_linear_offset"),
    "activation_func_clamp_value": ("mlp", "clamp"),
    "num_experts": ("experts", "num_experts"),
    **{
        ("moe_" + name if name != "capacity_factor" else "moe_expert_capacity_factor"): (
            "experts",
            name,
        )
        for name in _names(Experts)
        if name not in ("num_experts", "router")
    },
    **{"moe_router_" + name: ("experts.router", name) for name in _names(Router)},
    "mtp_num_layers": ("mtp", "num_layers"),
    "mtp_loss_scaling_factor": ("mtp", "loss_scaling_factor"),
}
# The flat switches that say whether an optional group is there, and their default.
SWITCHES = {"position": "learned", "multi_latent_attention": False}
GROUPS = ("attention", "rope", "mlp", "experts", "mtp")

# Each group's class, and what makes an optional one present (for the one-line refusals).
CLASSES = {
    "attention": Attention,
    "attention.mla": MLA,
    "rope": RoPE,
    "rope.yarn": YaRN,
    "mlp": MLP,
    "experts": Experts,
    "experts.router": Router,
    "mtp": MTP,
}
NEEDS = {
    "attention.mla": "multi_latent_attention=True",
    "rope": "position='rope'",
    "rope.yarn": "position='rope'",
    "experts": "num_experts",
    "experts.router": "num_experts",
    "mtp": "mtp_num_layers",
}


def _field_default(cls: type, attr: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == attr)
    if f.default is not dataclasses.MISSING:
        return f.default
    return None if f.default_factory is dataclasses.MISSING else f.default_factory()


FLAT_DEFAULTS = {name: _field_default(CLASSES[path], attr) for name, (path, attr) in FLAT.items()}


@dataclass(frozen=True, init=False)
class GPTConfig:
    """A GPT's shape, with its variants as groups (fmeg.models.config_groups). Made from the groups
    or from today's flat keywords (FLAT: Megatron's flag names), which checkpoints store."""

    # the tokenizer's vocabulary: logits and losses cover these ids
    vocab_size: int
    max_seq_len: int
    num_layers: int
    hidden_size: int
    num_heads: int
    # None: num_heads (multi-head attention)
    num_kv_heads: int | None = None
    # None: 4 * hidden; swiglu: Megatron's int(8 * hidden / 3 / 64) * 64
    ffn_hidden_size: int | None = None
    norm: str = "layernorm"
    activation: str = "gelu"
    tie_embeddings: bool = True
    bias: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02
    hidden_dropout: float = 0.0
    # rows of the embedding and output tables; None: vocab_size
    padded_vocab_size: int | None = None
    # Megatron's --apply-layernorm-1p: norm weights w start at 0, scale by 1 + w
    norm_zero_centered: bool = False
    attention: Attention = Attention()
    # None: learned positions
    rope: RoPE | None = None
    mlp: MLP = MLP()
    # None: every MLP is dense
    experts: Experts | None = None
    mtp: MTP | None = None

    def __init__(
        self,
        vocab_size: int,
        max_seq_len: int,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        **given: Any,
    ) -> None:
        sizes = dict(vocab_size=vocab_size, max_seq_len=max_seq_len, num_layers=num_layers)
        sizes |= dict(hidden_size=hidden_size, num_heads=num_heads)
        for f in dataclasses.fields(self):
            value = sizes[f.name] if f.name in sizes else given.pop(f.name, f.default)
            object.__setattr__(self, f.name, value)
        for name, group in _groups(self, given).items():
            object.__setattr__(self, name, group)
        if self.padded_vocab_size is None:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.ffn_hidden_size is None:
            ffn = 4 * self.hidden_size
            # Megatron rounds down (64 where that would leave nothing)
            if self.activation == "swiglu":
                ffn = max(64, 8 * self.hidden_size // 192 * 64)
            object.__setattr__(self, "ffn_hidden_size", ffn)
        validate(self)

    @property
    def position(self) -> str:
        """ "rope" or "learned" (Megatron's --position-embedding-type)."""
        return "learned" if self.rope is None else "rope"

    @property
    def head_dim(self) -> int:
        return self.attention.kv_channels or self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates (Megatron: kv_channels *
        rotary_percent; MLA: its rotary part, qk_pos_emb_head_dim); 0 without RoPE."""
        if self.attention.mla is not None:
            return self.attention.mla.qk_pos_emb_head_dim
        return int(self.head_dim * self.rope.percent) if self.rope else 0

    @property
    def mtp_depth(self) -> int:
        """How many multi-token prediction layers follow the decoder (0: none)."""
        return self.mtp.num_layers if self.mtp else 0

    def layer_window(self, index: int) -> int | None:
        """Layer `index`'s sliding window, or None for full attention: every layer's with an int
        skip frequency N but each N-th (Megatron counts layers from 1), or as the 1/0 list says
        (layers past it, multi-token prediction's, attend fully)."""
        window, freq = self.attention.window_size, self.attention.window_attn_skip_freq
        if window is None:
            return None
        if freq is None:
            return window
        if isinstance(freq, int):
            return window if (index + 1) % freq else None
        return window if index < len(freq) and freq[index] else None

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def flat(self) -> dict[str, Any]:
        """Today's flat fields (FLAT's names, SWITCHES, the shape's), an absent group's at their
        defaults: what checkpoints store and GPTConfig(**flat) reads back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in GROUPS:
            del out[name]
        out["position"] = self.position
        out["multi_latent_attention"] = self.attention.mla is not None
        for name, (path, attr) in FLAT.items():
            group = _at(self, path)
            out[name] = FLAT_DEFAULTS[name] if group is None else getattr(group, attr)
        return out

    def replace(self, **changes: Any) -> "GPTConfig":
        """A copy with changes, by flat name or group; an unpadded vocabulary stays unpadded when
        vocab_size changes."""
        if "vocab_size" in changes and self.padded_vocab_size == self.vocab_size:
            changes.setdefault("padded_vocab_size", None)
        kept = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return GPTConfig(**{**kept, **changes})

    @classmethod
    def gpt2(cls, **overrides: Any) -> "GPTConfig":
        """GPT-2 small (124M) unless overridden: learned positions, LayerNorm, tanh GELU, tied,
        biased."""
        base = dict(
            vocab_size=50257,
            max_seq_len=1024,
            num_layers=12,
            hidden_size=768,
            num_heads=12,
            norm="layernorm",
            activation="gelu_tanh",
            position="learned",
            tie_embeddings=True,
            bias=True,
            norm_eps=1e-5,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def llama(cls, **overrides: Any) -> "GPTConfig":
        """A Llama-style model (RoPE, RMSNorm, SwiGLU, no biases, untied) of about 1.3B by
        default."""
        base = dict(
            vocab_size=32000,
            max_seq_len=2048,
            num_layers=24,
            hidden_size=2048,
            num_heads=16,
            num_kv_heads=8,
            norm="rmsnorm",
            activation="swiglu",
            position="rope",
            tie_embeddings=False,
            bias=False,
            norm_eps=1e-6,
            rope_theta=10000.0,
        )
        return cls(**{**base, **overrides})


def _at(tree: Any, path: str) -> Any:
    """The group at a dotted path of a config (or of a {name: group} dict), None where absent."""
    node = tree
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part)
        if node is None:
            return None
    return node


def _put(tree: dict, path: str, group: Any) -> None:
    """Set the group at a dotted path of a {name: group} dict, rebuilding its parents."""
    head, _, leaf = path.rpartition(".")
    if not head:
        tree[leaf] = group
        return
    _put(tree, head, dataclasses.replace(_at(tree, head), **{leaf: group}))


def _groups(config: GPTConfig, flat: dict[str, Any]) -> dict[str, Any]:
    """The config's groups with today's flat keywords applied: the switches add or drop optional
    groups, each other name sets its group's field; a value for a group that is absent must be
    its default (else a ValueError naming it)."""
    unknown = sorted(set(flat) - set(FLAT) - set(SWITCHES))
    if unknown:
        raise TypeError(f"GPTConfig got unexpected keyword arguments: {', '.join(unknown)}")
    # as JSON metadata gives tuples back
    flat = {k: tuple(v) if isinstance(v, list) else v for k, v in flat.items()}
    tree = {name: getattr(config, name) for name in GROUPS}
    _switch(tree, flat)
    changes: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        path, attr = FLAT[name]
        changes.setdefault(path, {})[attr] = value
    # the deepest first: a router's changes before its experts'
    for path in sorted(changes, key=lambda p: -p.count(".")):
        group = _at(tree, path)
        if group is not None:
            _put(tree, path, dataclasses.replace(group, **changes[path]))
            continue
        for attr, value in changes[path].items():
            name = next(n for n, where in FLAT.items() if where == (path, attr))
            need(value == FLAT_DEFAULTS[name], name, f"has no effect without {NEEDS[path]}")
    return tree


def _switch(tree: dict[str, Any], flat: dict[str, Any]) -> None:
    """Add or drop the optional groups as the flat switches say (popping them from flat)."""
    position = flat.pop("position", None)
    if position is not None:
        need(position in POSITIONS, "position", f"must be one of {POSITIONS}, got {position!r}")
        tree["rope"] = (tree["rope"] or RoPE()) if position == "rope" else None
    mla_on = flat.pop("multi_latent_attention", None)
    if mla_on is not None:
        mla_group = (tree["attention"].mla or MLA()) if mla_on else None
        tree["attention"] = dataclasses.replace(tree["attention"], mla=mla_group)
    if "num_experts" in flat:
        e, experts = flat.pop("num_experts"), tree["experts"]
        made = (
            Experts(num_experts=e)
            if experts is None
            else dataclasses.replace(experts, num_experts=e)
        )
        tree["experts"] = None if e is None else made
    if "mtp_num_layers" in flat:
        depth, mtp = flat.pop("mtp_num_layers"), tree["mtp"]
        made = MTP(num_layers=depth) if mtp is None else dataclasses.replace(mtp, num_layers=depth)
        tree["mtp"] = None if depth is None else made


def _flat_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """({flat name: type}, {flat name: default}) of every name GPTConfig.flat() writes."""
    hints, defaults = {}, {}
    for f in dataclasses.fields(GPTConfig):
        if f.name in GROUPS:
            continue
        hints[f.name] = typing.get_type_hints(GPTConfig)[f.name]
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
    hints |= {"position": str, "multi_latent_attention": bool}
    defaults |= SWITCHES
    for name, (path, attr) in FLAT.items():
        hint = typing.get_type_hints(CLASSES[path])[attr]
        # the numbers that make an optional group: None when it is absent
        hints[name] = hint | None if name in ("num_experts", "mtp_num_layers") else hint
        defaults[name] = FLAT_DEFAULTS[name]
    return hints, defaults


# The flat names checkpoints store: their types and defaults (a field added later has its default).
FLAT_HINTS, SAVED_DEFAULTS = _flat_schema()
