"""Parameter pytrees: nested dicts and lists of tensors, addressed by dotted paths.

A path names a leaf the way Megatron and checkpoints do: "layers.3.attn.qkv.weight" is
params["layers"][3]["attn"]["qkv"]["weight"]. Everything here is a pure function of trees.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree


Tree = Any

tree_map = pytree.tree_map
tree_leaves = pytree.tree_leaves
tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten


def _key_str(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_of(key_path: tuple) -> str:
    """The dotted path of a pytree key path."""
    return ".".join(_key_str(k) for k in key_path)


def items(tree: Tree) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, leaf) pairs in the tree's canonical order."""
    leaves, spec = pytree.tree_flatten(tree)
    return zip(paths_of(spec), leaves)


@functools.lru_cache(maxsize=1024)
def paths_of(spec: pytree.TreeSpec) -> tuple[str, ...]:
    """The dotted paths of a tree structure's leaves, in order; cached, since the executor asks for
    the same few structures (a layer's, a stage's) every microbatch and key paths cost more than the
    flatten."""
    flat, _ = pytree.tree_flatten_with_path(
        pytree.tree_unflatten([object() for _ in range(spec.num_leaves)], spec)
    )
    return tuple(path_of(key_path) for key_path, _ in flat)


def flatten(tree: Tree) -> dict[str, torch.Tensor]:
    """{path: leaf}, the form checkpoints and interop use."""
    return dict(items(tree))


def unflatten(flat: dict[str, Any]) -> Tree:
    """Inverse of flatten: numeric path parts become list indices."""
    root: dict = {}
    for path, leaf in flat.items():
        parts = path.split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = leaf
    return _lists_from_numeric_dicts(root)


def _lists_from_numeric_dicts(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = {k: _lists_from_numeric_dicts(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node):
        keys = sorted(node, key=int)
        if [int(k) for k in keys] == list(range(len(keys))):
            return [node[k] for k in keys]
    return node


def map_with_path(fn: Callable[[str, Any], Any], tree: Tree, *rest: Tree) -> Tree:
    """tree_map whose function also receives the leaf's dotted path."""
    return pytree.tree_map_with_path(lambda kp, *xs: fn(path_of(kp), *xs), tree, *rest)


def num_params(tree: Tree) -> int:
    return sum(leaf.numel() for leaf in tree_leaves(tree))


def global_norm(tree: Tree) -> torch.Tensor:
    """L2 norm over every leaf, accumulated in at least fp32."""
    # each leaf at least in fp32 (bf16/fp16 promoted; fp32 and fp64 kept, no copy)
    leaves = [leaf.to(torch.promote_types(leaf.dtype, torch.float32)) for leaf in tree_leaves(tree)]
    if not leaves:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(leaves)))
