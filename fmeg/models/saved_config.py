"""A checkpoint's model configuration against this run's: what must match to load it, and what may
change.

    saved = saved_model(meta["model"], where="ck/iter_0000010/metadata.json")   # ValueError if a
    newer fmeg wrote it differing(saved, config)        # fields that must match and do not
    changed_on_load(saved, config)  # 'name saved -> now' for the settings a load may change
"""

from __future__ import annotations

import types
import typing

from fmeg.models.gpt import GPTConfig
from fmeg.models.gpt_config import FLAT_HINTS, SAVED_DEFAULTS

# Model settings that are not part of any parameter's shape and that a run may change when it loads
# a checkpoint (Megatron loads the weights whatever they are): regularisation, the initialisation
# (unused on load), and RoPE's base and context length (continued pretraining at a longer context).
CHANGEABLE_ON_LOAD = (
    "hidden_dropout",
    "attention_dropout",
    "init_std",
    "rope_theta",
    # how experts are trained, not what they are: a run may resume with other balance losses or
    # capacity
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity",
    "moe_router_bias_update_rate",
    "moe_token_dispatcher_type",
)


def model_fields(config: GPTConfig) -> dict:
    """What must match to resume: the model config less its vocabulary padding (which follows tp and
    is redone on load)."""
    fields = config.flat()
    fields.pop("padded_vocab_size")
    return _one_spelling(fields)


def _one_spelling(fields: dict) -> dict:
    """kv_channels equal to hidden_size / num_heads is the default head dimension, however it was
    given."""
    if (
        fields.get("kv_channels") is not None
        and fields["kv_channels"] * fields["num_heads"] == fields["hidden_size"]
    ):
        fields = {**fields, "kv_channels": None}
    return fields


def saved_model(model: dict, where: str) -> dict:
    """The checkpoint's model fields, with the defaults of fields added since it was written; a
    field this fmeg does not know (a newer fmeg wrote it) is a ValueError naming it."""
    known = FLAT_HINTS
    unknown = sorted(set(model) - set(known))
    if unknown:
        raise ValueError(
            f"{where}: names model fields this fmeg does not know ({', '.join(unknown)}): a newer "
            "fmeg wrote it; upgrade fmeg to read it"
        )
    saved = {
        **SAVED_DEFAULTS,
        **{k: tuple(v) if isinstance(v, list) else v for k, v in model.items()},
    }
    for name, value in saved.items():
        if not _fits(value, known[name]):
            raise ValueError(
                f"{where}: model field {name} is {value!r} ({type(value).__name__}), not "
                f"{_spelled(known[name])}; the file is damaged: restore it"
            )
    # JSON gave tuples (rope_scaling) back as lists
    saved.pop("padded_vocab_size", None)
    return _one_spelling(saved)


def _fits(value, hint) -> bool:
    """Whether a value read from JSON has a config field's type (an int is a float; a bool is no
    number)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(_fits(v, h) for v, h in zip(value, args))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _spelled(hint) -> str:
    return " or ".join(
        getattr(h, "__name__", str(h)).replace("NoneType", "null")
        for h in (
            typing.get_args(hint)
            if typing.get_origin(hint) in (typing.Union, types.UnionType)
            else (hint,)
        )
    )


def _changeable(config: GPTConfig) -> tuple[str, ...]:
    return CHANGEABLE_ON_LOAD + (("max_seq_len",) if config.position != "learned" else ())


def differing(saved: dict, config: GPTConfig) -> list[str]:
    """The fields that must match to load the checkpoint and do not."""
    now = model_fields(config)
    return sorted(k for k, v in now.items() if saved.get(k) != v and k not in _changeable(config))


def changed_on_load(saved: dict, config: GPTConfig) -> list[str]:
    """'name saved -> now' for each setting that differs but may change on load (CHANGEABLE_ON_LOAD,
    and the context length of a model without learned positions)."""
    now = model_fields(config)
    return [
        f"{k} {saved.get(k)} -> {now[k]}" for k in _changeable(config) if saved.get(k) != now[k]
    ]
