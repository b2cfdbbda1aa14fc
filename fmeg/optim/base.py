"""Optimizers as gradient transformations, optax's shape: a pair of pure functions over pytrees.

    tx = chain(clip_by_global_norm(1.0), scale_by_adam(), add_decayed_weights(),
        scale_by_learning_rate())
    state = tx.init(params)
    updates, state = tx.update(grads, state, params, lr=lr, weight_decay=wd)
    params = apply_updates(params, updates)

A flat form (fmeg.state.flat steps it) has moment_dtypes, kinds (the buffers it keeps: "mu",
"nu"), name, group(path, leaf) (the leaves one call steps together) and step_(views, steps, group,
...); a matrix optimizer's also answers group "muon" for its matrices and has prepare_,
whole_step, apply_ and fresh_state (fmeg.state.matrix_step runs them).

The step's hyperparameters (lr, weight_decay, decoupled_lr) are keyword arguments of update, not
state: schedules count samples, which only the runner knows, and a compiled step given them as 0-d
tensors never recompiles when they change. Each transform takes the keywords it knows and ignores
the rest. Nothing is updated in place. A transform may also say how it runs on the runner's flat
buffers (its `flat`): the same update, one fused kernel per buffer group, never a second optimizer.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fmeg import tree

Tree = Any


class GradientTransformation(NamedTuple):
    """init(params) -> state; update(updates, state, params=None, **hyperparameters) -> (updates,
    state). flat: the same transform over flat buffers (an object the runner's state steps in
    place), or None."""

    init: Callable[[Tree], Any]
    update: Callable[..., tuple[Tree, Any]]
    flat: Any = None


class EmptyState(NamedTuple):
    """The state of a transform that keeps none."""


def stateless(update: Callable[..., Tree]) -> GradientTransformation:
    """A transform from update(updates, params, **hyperparameters) -> updates, keeping no state."""
    return GradientTransformation(
        lambda params: EmptyState(),
        lambda updates, state, params=None, **hyper: (update(updates, params, **hyper), state),
    )


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """The transforms applied in order; the state is the tuple of their states."""

    def init(params: Tree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(
        updates: Tree, state: tuple, params: Tree = None, **hyper: Any
    ) -> tuple[Tree, tuple]:
        states = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params, **hyper)
            states.append(s)
        return updates, tuple(states)

    return GradientTransformation(init, update)


def apply_updates(params: Tree, updates: Tree) -> Tree:
    """params + updates, leaf by leaf, in each parameter's dtype."""
    leaves, spec = tree.tree_flatten(params)
    new = torch._foreach_add(
        leaves, [u.to(p.dtype) for u, p in zip(tree.tree_leaves(updates), leaves)]
    )
    return tree.tree_unflatten(new, spec)


def without_stage(path: str) -> str:
    """A flat state's leaf path without its pipeline stage ("0.layers.1..." -> "layers.1..."): the
    path a model's rules name (flat forms are asked about "stage.path" leaves)."""
    stage, _, rest = path.partition(".")
    return rest if stage.isdigit() else path


def partition(
    transforms: dict[str, GradientTransformation], label: Callable[[str, torch.Tensor], str]
) -> GradientTransformation:
    """Each leaf stepped by the transform its label(path, leaf) names (optax's partition): Muon's
    matrices and its scalar optimizer's leaves. Each transform sees a flat {path: leaf} dict of its
    leaves; the state is {label: that transform's state}."""

    def split(values: Tree, params: Tree) -> dict[str, dict[str, Any]]:
        parts: dict[str, dict[str, Any]] = {name: {} for name in transforms}
        for (path, p), v in zip(tree.items(params), tree.tree_leaves(values)):
            parts[label(path, p)][path] = v
        return parts

    def init(params: Tree) -> dict:
        return {name: transforms[name].init(part) for name, part in split(params, params).items()}

    def update(updates: Tree, state: dict, params: Tree = None, **hyper: Any):
        leaves, spec = tree.tree_flatten(updates)
        ups, ps = split(updates, params), split(params, params)
        out, new = {}, {}
        for name, tx in transforms.items():
            # a transform with no leaves keeps its state (foreach kernels refuse empty lists)
            if not ups[name]:
                new[name] = state[name]
                continue
            out_part, new[name] = tx.update(ups[name], state[name], ps[name], **hyper)
            out.update(out_part)
        return tree.tree_unflatten([out[path] for path, _ in tree.items(params)], spec), new

    return GradientTransformation(init, update)
