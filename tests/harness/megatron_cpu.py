"""megatron-core's distributed optimizer on CPU: it allocates on "cuda" by name, checks that its
parameters are torch.cuda tensors and waits on CUDA streams and events. Imported (for its effect)
only by tests/harness/megatron_core_run.py's training processes: tensors asked for on cuda are made
on the CPU, type() names CPU tensors as their CUDA twins, streams and events do nothing."""

import functools
import torch


def _cpu(dev):
    if dev is None:
        return dev
    s = str(dev)
    return "cpu" if s.startswith("cuda") else dev


def _wrap(fn):
    @functools.wraps(fn)
    def inner(*a, **k):
        if "device" in k:
            k["device"] = _cpu(k["device"])
        return fn(*a, **k)

    return inner


for name in [
    "tensor",
    "zeros",
    "empty",
    "ones",
    "full",
    "arange",
    "zeros_like",
    "empty_like",
    "ones_like",
    "full_like",
    "randn",
    "rand",
    "as_tensor",
]:
    setattr(torch, name, _wrap(getattr(torch, name)))
_to = torch.Tensor.to


def to(self, *a, **k):
    a = tuple(_cpu(x) if isinstance(x, (str, torch.device)) else x for x in a)
    if "device" in k:
        k["device"] = _cpu(k["device"])
    return _to(self, *a, **k)


torch.Tensor.to = to
torch.Tensor.cuda = lambda self, *a, **k: self
torch.cuda.current_device = lambda: "cpu"
torch.cuda.synchronize = lambda *a, **k: None


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        pass


class _Event:
    def __init__(self, *a, **k):
        pass

    def record(self, *a):
        pass

    def wait(self, *a):
        pass

    def synchronize(self):
        pass


torch.cuda.Stream = _Stream
torch.cuda.Event = _Event
torch.cuda.current_stream = lambda *a, **k: _Stream()
torch.cuda.stream = lambda s: _Stream()
_type = torch.Tensor.type


def _typed(self, *a, **k):
    if a or k:
        return _type(self, *a, **k)
    return _type(self).replace("torch.", "torch.cuda.", 1)


torch.Tensor.type = _typed


def _without_step(set_states):
    """megatron-core without Apex or TE keeps torch's per-parameter "step" in Adam's state, which
    its fully reshardable load does not hold (the param groups carry it): leave it as it is. Its
    dp_reshardable load copies into fp32 parameters' shards (views of leaves that require grad)
    outside no_grad, which autograd refuses: the copy runs under no_grad, as its fully reshardable
    load's does."""

    @functools.wraps(set_states)
    def inner(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        step = state.pop("step", None)
        try:
            with torch.no_grad():
                set_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    return inner


from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402

DistributedOptimizer._set_main_param_and_optimizer_states = _without_step(
    DistributedOptimizer._set_main_param_and_optimizer_states
)
