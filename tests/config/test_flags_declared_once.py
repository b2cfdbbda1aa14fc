"""Every flag of the runner is declared in exactly one place: a field of one group in
fmeg.config.arguments.GROUPS (or a row of a group's ACCEPTED table of Megatron flags it ignores or
refuses), and the parser is derived from those declarations alone."""

import argparse
import ast
import dataclasses
import typing

from fmeg.config.arguments import GROUPS, build_parser, parse_args
from fmeg.config.declare import flags_of, names_of
from harness.paths import ROOT

# The parser's own flags, not settings of a run.
OWN = {"--help", "-h", "--config"}


def test_each_parser_flag_has_exactly_one_declaration():
    declared = [name for cls in GROUPS for name in names_of(cls)]
    twice = sorted({name for name in declared if declared.count(name) > 1})
    assert twice == [], f"declared twice: {twice}"
    parsed = {o for a in build_parser()._actions for o in a.option_strings} - OWN
    assert sorted(parsed ^ set(declared)) == []


def test_help_shows_every_flag_not_hidden_and_train_iters_excludes_train_samples():
    parser = build_parser()
    text = parser.format_help()
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and a.option_strings]
    assert [a.option_strings[0] for a in shown if a.option_strings[0] not in text] == []
    exclusive = [[a.dest for a in g._group_actions] for g in parser._mutually_exclusive_groups]
    assert exclusive == [["train_iters", "train_samples"]]


def test_only_the_declarations_add_flags_to_the_runners_parser():
    callers = []
    for path in sorted((ROOT / "fmeg" / "config").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if is_call and node.func.attr == "add_argument":
                callers.append(f"{path.name}:{node.lineno}")
    # declare.add_group, and arguments.build_parser's --config
    assert [c.split(":")[0] for c in callers] == ["arguments.py"] + ["declare.py"] * 3, callers


def _holds(value, hint) -> bool:
    """Whether value is of the annotated type (unions, list[...], tuple[...] and Any)."""
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, __import__("types").UnionType):
        return any(_holds(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin in (list, tuple):
        items = typing.get_args(hint)
        inner = items[0] if items else typing.Any
        return isinstance(value, origin) and all(_holds(v, inner) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def test_each_group_holds_what_its_annotations_say_for_defaults_and_given_values():
    argv = [
        "--rampup-batch-size", "4", "4", "100", "--data-path", "1", "a", "--window-size", "8,0",
        "--window-attn-skip-freq", "2", "--moe-layer-freq", "[1,0]", "--compile",
        "--tiktoken-special-tokens", "<s>", "--recompute-modules", "mlp",
    ]  # fmt: skip
    for args in (parse_args([], world_size=1), parse_args(argv, world_size=1)):
        for cls in GROUPS:
            group = cls.from_namespace(args)
            hints = typing.get_type_hints(cls)
            for field in dataclasses.fields(group):
                value = getattr(group, field.name)
                assert _holds(value, hints[field.name]), (cls.__name__, field.name, value)


def test_groups_are_frozen_and_keyword_only():
    for cls in GROUPS:
        params = dataclasses.fields(cls)
        assert all(f.kw_only for f in params), cls
        assert cls.__dataclass_params__.frozen, cls
        assert all(name.startswith("-") for _, f in flags_of(cls) for name in f.names)
