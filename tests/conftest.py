"""Hypothesis profiles: "ci" (the default) keeps the suite within CI's budget; "dev" searches
harder.

    HYPOTHESIS_PROFILE=dev pytest
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# one thread in each of pytest-xdist's workers (they share the machine's cores), else at most 2
torch.set_num_threads(
    1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads()))
)
# every command a test starts (the session's one-rank reference curves too) computes with one
# thread, as torchrun gives each worker: float32 reductions split by the thread count, so a one-rank
# run with the machine's count and its resumed or multi-rank counterpart with one summed differently
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_sessionfinish(session, exitstatus):
    from harness.parallel import close_pools
    from harness.runner import WARM

    close_pools()
    WARM.close()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Single-rank CPU loss curves every layout is compared with (computed once per test session);
    on CPU even where a GPU is present, so that tests/test_cuda.py compares the GPU with the CPU."""
    from harness.runner import DROPOUT, run_layout

    tmp = tmp_path_factory.mktemp("reference")
    cpu = ["--device", "cpu"]
    return {
        "plain": run_layout(tmp, "single", 1, cpu),
        "dropout": run_layout(tmp, "single_dropout", 1, DROPOUT + cpu),
    }


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory):
    """A small trained checkpoint (harness.runner.small_checkpoint), made once per test session."""
    from harness.runner import small_checkpoint

    return small_checkpoint(tmp_path_factory.mktemp("trained") / "ckpt")


_OURS = ("recipes.", "fmeg.launch", "torch.distributed.run", "bench/")


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(monkeypatch):
    """Every fmeg command a test starts (recipes, the launcher, torchrun) runs in a session of its
    own, and its whole process group and every process below it (torchrun's workers, each in a
    session of its own) are killed when the test ends, pass, fail or timeout."""
    import subprocess

    from fmeg.testing.processes import kill_tree

    started, real_init = [], subprocess.Popen.__init__

    def init(self, args, *rest, **kwargs):
        ours = any(
            word in str(a)
            for a in (args if isinstance(args, (list, tuple)) else [args])
            for word in _OURS
        )
        if ours:
            kwargs.setdefault("start_new_session", True)
        real_init(self, args, *rest, **kwargs)
        if ours and kwargs.get("start_new_session"):
            started.append(self.pid)

    monkeypatch.setattr(subprocess.Popen, "__init__", init)
    yield
    # a command run in this process must not switch autograd off for
    leaked = not torch.is_grad_enabled()
    torch.set_grad_enabled(True)  # the tests after it
    assert not leaked, (
        "the test left autograd disabled (torch.set_grad_enabled(False) without restoring it)"
    )
    for pid in started:
        try:
            kill_tree(pid)
        except PermissionError:
            pass
