"""The warm pool runs a command as torchrun --standalone would: each rank's variables, output and
exit, the first failure ending the others, a timeout ending all, and no process left behind; a
run of the real recipe gives torchrun's curve bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from fmeg.testing.warm_pool import WarmPool

# A rank program: prints its variables, then behaves as argv says.
PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    import warm_preloaded  # imported by the server already: its import line is printed again
    rank = int(os.environ.get("RANK", "0"))
    print("rank", rank, os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_RANK"), sys.argv[1:],
          flush=True)
    what = sys.argv[1]
    if what in ("fail", "hang"):
        with open(f"pid{rank}", "w") as f:
            f.write(str(os.getpid()))
    if what == "fail" and rank == 1:
        while not os.path.exists("pid0"):
            time.sleep(0.01)
        sys.exit(3)
    if what in ("fail", "hang"):
        time.sleep(600)
    if what == "code":
        sys.exit(int(sys.argv[2]))
    """
)


@pytest.fixture
def pool(tmp_path, monkeypatch):
    (tmp_path / "rank_program.py").write_text(PROGRAM)
    (tmp_path / "warm_preloaded.py").write_text("import sys\nprint('imported', file=sys.stderr)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = WarmPool(preload=["warm_preloaded"], env={"PYTHONPATH": str(tmp_path)})
    yield pool
    pool.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_ranks_get_torchruns_variables_and_the_import_time_output(pool):
    done = pool.run("rank_program", ["ok", "--flag"], nproc=2, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        "rank 0 2 0 ['ok', '--flag']",
        "rank 1 2 1 ['ok', '--flag']",
    ]
    assert done.stderr.splitlines() == ["imported", "imported"]


def test_one_rank_exits_with_its_own_code(pool):
    assert pool.run("rank_program", ["code", "7"], nproc=1, timeout=60).returncode == 7
    assert pool.run("rank_program", ["code", "0"], nproc=1, timeout=60).returncode == 0


def test_a_failed_rank_ends_the_others_and_the_run_exits_1(pool, tmp_path):
    start = time.monotonic()
    done = pool.run("rank_program", ["fail"], nproc=2, timeout=120)
    assert done.returncode == 1 and time.monotonic() - start < 60
    assert _gone(int((tmp_path / "pid0").read_text()))


def test_a_timeout_raises_and_ends_every_rank(pool, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        pool.run("rank_program", ["hang"], nproc=2, timeout=3)
    assert all(_gone(int((tmp_path / f"pid{r}").read_text())) for r in range(2))
    # and the server goes on serving
    assert pool.run("rank_program", ["code", "0"], nproc=1, timeout=60).returncode == 0


def test_closing_the_pool_leaves_no_process(tmp_path):
    (tmp_path / "warm_preloaded.py").write_text("")
    (tmp_path / "nothing.py").write_text("")
    pool = WarmPool(preload=["warm_preloaded"], env={"PYTHONPATH": str(tmp_path)})
    assert pool.run("nothing", [], nproc=1, timeout=60, cwd=str(tmp_path)).returncode == 0
    server = pool._proc.pid
    pool.close()
    assert _gone(server)


def test_the_recipe_on_the_pool_gives_torchruns_curve_bit_for_bit(tmp_path):
    from harness.runner import COMMON, WARM

    from fmeg.testing.processes import run_in_own_group

    flags = [*COMMON, "--train-iters", "6", "--tensor-model-parallel-size", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    real = run_in_own_group(
        [
            *torchrun,
            "--nproc-per-node=2",
            "-m",
            "recipes.gpt_pretrain",
            *flags,
            "--log-dir",
            str(tmp_path / "real"),
        ],
        timeout=600,
    )
    assert real.returncode == 0, real.stderr[-3000:]
    warm = WARM.run("recipes.gpt_pretrain", [*flags, "--log-dir", str(tmp_path / "warm")], 2, 600)
    assert warm.returncode == 0, warm.stderr[-3000:]
    records = [
        [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("real", "warm")
    ]
    keys = ("lm_loss", "grad_norm")
    assert [[r.get(k) for k in keys] for r in records[0]] == [
        [r.get(k) for k in keys] for r in records[1]
    ]
    assert len(records[0]) == 6
