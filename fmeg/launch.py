"""torchrun, with the workers' exit passed through: `python -m fmeg.launch` takes torchrun's flags.

    python -m fmeg.launch --nproc-per-node 4 -m recipes.gpt_pretrain --tensor-model-parallel-size 2

torchrun reports any failed worker with a traceback of its own and exits 1, whatever the worker said, and
when it is sent SIGTERM it stops the workers and exits 1 even after they saved and exited 0. This launcher
runs torchrun's own code (same flags, same rendezvous, same worker environment) and differs only at the end:

- a worker's exit code is the launcher's (2 for bad input, whose one line the worker printed), with no
  traceback and no report of torchrun's;
- a worker killed by a signal is named in one line, and the exit code is 128 + the signal's number;
- SIGTERM is forwarded to the workers, and the launcher exits as they do: 0 once they have saved a
  checkpoint and exited under --exit-signal-handler (on Linux; elsewhere torchrun handles SIGTERM).
"""

from __future__ import annotations

import logging
import os
import signal
import sys


def _children(pid: int) -> list[int]:
    """The ids of the processes whose parent is pid (torchrun's workers are the launcher's children)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
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


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning banner
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the outcome is said below
    args = torchrun.parse_args(argv)
    if os.path.isdir("/proc"):  # Linux: SIGTERM is forwarded here, so that the workers' exit decides ours
        args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() != "SIGTERM")
        signal.signal(signal.SIGTERM, _forward)
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:
            print(f"error: rank {rank} was killed by {failure.signal_name()}; the other ranks were stopped",
                  file=sys.stderr)
            return 128 - failure.exitcode
        return failure.exitcode  # the worker printed why
    except SignalException as e:
        print(f"error: stopped by {signal.Signals(e.sigval).name}; the workers were sent it", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
