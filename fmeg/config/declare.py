"""Each flag declared once: a field of a frozen, keyword-only dataclass (a group) whose metadata is
its flag. The parser and --help, the YAML loader, docs/flags.md and the typed groups a run reads
are all derived from these fields.

    @group("multi-token prediction")
    class MTPFlags:
        mtp_num_layers: int | None = flag("--mtp-num-layers", type=int, help="extra layers")

    add_group(parser, MTPFlags)                  # the argparse group, dest = the field's name
    MTPFlags.from_namespace(args)                # the typed, frozen group of a parsed run

A group may also accept Megatron flags it does not act on (`ACCEPTED`: flag -> argparse keywords,
help included), rows of the tables of ignored and refused flags that name why.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable


# argparse's --x / --no-x switch with a third state, None, when neither is given.
BOTH_WAYS = argparse.BooleanOptionalAction


@dataclass(frozen=True)
class Flag:
    """A field's flag: its names, argparse's keywords (but dest and default: the field's), the
    store_false twin that turns a default-on switch off, and the mutually exclusive set it is in."""

    names: tuple[str, ...]
    options: dict[str, Any]
    negation: tuple[str, str] | None = None
    exclusive: str | None = None


def flag(
    *names: str,
    default: Any = None,
    negation: tuple[str, str] | None = None,
    exclusive: str | None = None,
    **options: Any,
) -> Any:
    """A dataclass field declaring the flag `names` (argparse's keywords in `options`)."""
    metadata = {"flag": Flag(tuple(names), options, negation, exclusive)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def switch(*names: str, default: bool = False, **options: Any) -> Any:
    """A dataclass field declaring an on/off flag (argparse's store_true; see `flag`)."""
    return flag(*names, default=default, action="store_true", **options)


def group(title: str) -> Callable[[type], type]:
    """Make a class a frozen, keyword-only group of flags under the --help title `title`."""

    def make(cls: type) -> type:
        cls = dataclass(frozen=True, kw_only=True)(cls)
        cls.TITLE = title
        cls.ACCEPTED = cls.__dict__.get("ACCEPTED", {})
        cls.from_namespace = classmethod(_from_namespace)
        if not hasattr(cls, "problems"):
            cls.problems = _no_problems
        return cls

    return make


def _no_problems(self: Any) -> list[str]:
    """A group without checks of its own."""
    return []


def _from_namespace(cls: type, args: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def flags_of(cls: type) -> list[tuple[str, Flag]]:
    """(field name, flag) of each declared field, in declaration order."""
    return [(f.name, f.metadata["flag"]) for f in dataclasses.fields(cls)]


def names_of(cls: type) -> list[str]:
    """Every flag name the group declares: its fields', their negations' and its accepted ones."""
    out = [name for _, f in flags_of(cls) for name in f.names]
    out += [f.negation[0] for _, f in flags_of(cls) if f.negation]
    both_ways = [f for _, f in flags_of(cls) if f.options.get("action") is BOTH_WAYS]
    out += [f"--no-{name[2:]}" for f in both_ways for name in f.names]
    return out + list(cls.ACCEPTED)


def add_group(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add the group's flags to the parser under its title, each field's default as argparse's."""
    g = parser.add_argument_group(cls.TITLE)
    exclusive: dict[str, Any] = {}
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for dest, f in flags_of(cls):
        target = g
        if f.exclusive is not None:
            if f.exclusive not in exclusive:
                exclusive[f.exclusive] = g.add_mutually_exclusive_group()
            target = exclusive[f.exclusive]
        spec = defaults[dest]
        default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
        target.add_argument(*f.names, dest=dest, default=default, **f.options)
        if f.negation:
            name, help = f.negation
            g.add_argument(name, dest=dest, action="store_false", help=help)
    for name, options in cls.ACCEPTED.items():
        g.add_argument(name, **options)


def flag_name(group: Any, name: str) -> str:
    """The flag that declares the group's field `name`, as a user types it."""
    return next(f.names[0] for dest, f in flags_of(type(group)) if dest == name)


def not_positive(group: Any, *names: str) -> list[str]:
    """'--flag must be positive, got V' for each named field that is not (None, unset, passes)."""
    values = {name: getattr(group, name) for name in names}
    return [
        f"{flag_name(group, name)} must be positive, got {value}"
        for name, value in values.items()
        if value is not None and value <= 0
    ]


def outside(group: Any, name: str, low: float, high: float) -> list[str]:
    """'--flag must be in [low, high), got V' when the field is outside that range."""
    value = getattr(group, name)
    if low <= value < high:
        return []
    return [f"{flag_name(group, name)} must be in [{low:g}, {high:g}), got {value}"]
