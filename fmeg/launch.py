"""torchrun, with the workers' exit passed through: `python -m fmeg.launch` takes torchrun's flags.

    python -m fmeg.launch --nproc-per-node 4 -m recipes.gpt_pretrain --tensor-model-parallel-size 2

torchrun reports any failed worker with a traceback of its own and exits 1, whatever the worker
said, and when it is sent SIGTERM it stops the workers and exits 1 even after they saved and exited
0. This launcher runs torchrun's own code (same flags, same rendezvous, same worker environment) and
differs only at the end:

- a worker's exit code is the launcher's (2 for bad input, whose one line the worker printed), with
  no traceback and no report of torchrun's; each refusal is printed once, by the first rank to reach
  it, so a line is never lost to the race of ranks exiting (fmeg.cli.print_refusal);
- a worker killed by a signal is named in one line, and the exit code is 128 + the signal's number;
- SIGTERM is forwarded to the workers, and the launcher exits as they do: 0 once they have saved a
  checkpoint and exited under --exit-signal-handler (on Linux; elsewhere torchrun handles SIGTERM).

With torchrun's --max-restarts N, a job that loses a rank (killed, or stopped and found silent by
the others after --distributed-timeout-minutes) is restarted whole, up to N times, and the runner
resumes from the newest complete checkpoint under --save (fmeg.training.run_state). Each restart is
one line on stdout naming its cause; a worker that refused its input (exit 2) is never restarted,
since it would meet the same input. Workers that are stopped (SIGSTOP) when the group is taken down
are killed at once rather than after torchrun's 30 s grace.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile

from fmeg.cli import REFUSALS, one_line, refuse


def _children(pid: int) -> list[int]:
    """The ids of the processes whose parent is pid (torchrun's workers are the launcher's
    children)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            # gone meanwhile
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _forward(signum: int, frame) -> None:
    for child in _children(os.getpid()):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass


def argument_problems(args) -> list[str]:
    """torchrun's flags that its own code would end in a traceback, one line each."""
    problems = []
    n = str(args.nproc_per_node)
    if n == "gpu" and not _cuda():
        problems.append(
            "--nproc-per-node gpu: no GPU is visible (torch.cuda.is_available() is False); give a "
            "number of processes"
        )
    elif n not in ("auto", "cpu", "gpu", "xpu") and not (n.isdigit() and int(n) > 0):
        problems.append(
            f"--nproc-per-node {n}: give a positive number of processes per node, or auto, cpu or "
            "gpu"
        )
    nodes = str(args.nnodes).split(":")
    if not (
        1 <= len(nodes) <= 2
        and all(x.isdigit() and int(x) > 0 for x in nodes)
        and int(nodes[0]) <= int(nodes[-1])
    ):
        problems.append(
            f"--nnodes {args.nnodes}: give a positive number of nodes, or MIN:MAX with 0 < MIN <= "
            "MAX"
        )
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        problems.append(f"--master-port {args.master_port}: a port is a number from 1 to 65535")
    if args.node_rank < 0:
        problems.append(f"--node-rank {args.node_rank}: must be >= 0")
    if args.max_restarts < 0:
        problems.append(f"--max-restarts {args.max_restarts}: must be >= 0 (0: no restart)")
    return problems


def cause(failures: dict) -> tuple[int, object]:
    """(rank, failure) that explains a failed group: a rank killed by a signal the agent did not
    send, else one that exited with a code of its own, else the first (the agent ends the others
    with SIGTERM)."""

    def rank_of(item):
        code = item[1].exitcode
        own = 0 if code < 0 and code != -signal.SIGTERM else 1 if code > 0 else 2
        return own, item[1].timestamp, item[0]

    return min(failures.items(), key=rank_of)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _stopped(pid: int) -> bool:
    """Whether a process is stopped (state T: SIGSTOP, or t: a tracer), which ignores SIGTERM until
    continued."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def _watch_restarts() -> None:
    """torchrun's agent, with one line for each restart and stopped workers killed when the group
    stops."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    monitor, restart, close = (
        LocalElasticAgent._monitor_workers,
        LocalElasticAgent._restart_workers,
        PContext.close,
    )

    def monitored(self, group):
        self._fmeg_result = monitor(self, group)
        failures = getattr(self._fmeg_result, "failures", None) or {}
        if any(f.exitcode == 2 for f in failures.values()):
            # a refusal of the input: a restart would meet it again
            self._remaining_restarts = 0
        return self._fmeg_result

    def restarting(self, group):
        failures = getattr(getattr(self, "_fmeg_result", None), "failures", None) or {}
        spec = group.spec
        why = "a worker failed"
        if failures:
            rank, failure = cause(failures)
            why = f"rank {rank} " + (
                f"was killed by {failure.signal_name()}"
                if failure.exitcode < 0
                else f"exited with code {failure.exitcode}"
            )
        print(
            f"restarting the workers ({spec.max_restarts - self._remaining_restarts} of "
            f"{spec.max_restarts}): {why}; they resume from the newest complete checkpoint under "
            "--save",
            flush=True,
        )
        return restart(self, group)

    def closing(self, *args, **kwargs):
        for pid in self.pids().values():
            if _stopped(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return close(self, *args, **kwargs)

    LocalElasticAgent._monitor_workers, LocalElasticAgent._restart_workers = monitored, restarting
    PContext.close = closing


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # torchrun's default, without its warning banner
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the outcome is said below
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    parser = torchrun.get_args_parser()
    # as every fmeg command: --nproc-per-nod is not --nproc-per-node
    parser.allow_abbrev = False
    # not the usage
    parser.error = lambda message: refuse(f"{one_line(message, parser._actions)}; see --help")
    args = parser.parse_args(argv)
    problems = argument_problems(args)
    if problems:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    # Linux: SIGTERM is forwarded here, so that the workers' exit decides ours
    if os.path.isdir("/proc"):
        args.signals_to_handle = ",".join(
            s for s in args.signals_to_handle.split(",") if s.strip() != "SIGTERM"
        )
        signal.signal(signal.SIGTERM, _forward)
    if os.path.isdir("/proc"):
        _watch_restarts()
    # each refusal printed once, by the rank first to it
    refusals = tempfile.mkdtemp(prefix="fmeg-refusals-")
    os.environ[REFUSALS] = refusals
    # torchrun keeps its own directory (torchelastic_*) under /tmp after every run: ours goes
    # with the refusals' unless the user named one
    if args.log_dir is None:
        args.log_dir = os.path.join(refusals, "torchelastic")
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        # the first to fail: ranks after it were stopped by the agent
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:
            print(
                f"error: rank {rank} was killed by {failure.signal_name()}; the other ranks were "
                "stopped",
                file=sys.stderr,
            )
            return 128 - failure.exitcode
        # the worker printed why
        return failure.exitcode
    except SignalException as e:
        print(
            f"error: stopped by {signal.Signals(e.sigval).name}; the workers were sent it",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    finally:
        shutil.rmtree(refusals, ignore_errors=True)
        os.environ.pop(REFUSALS, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
