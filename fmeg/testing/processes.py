"""A command run in a process group of its own, the whole group killed when it ends: torchrun's
workers never outlive the run that started them, whether it finished, failed or timed out.

    done = run_in_own_group([sys.executable, "-m", "recipes.gpt_pretrain", ...], timeout=600)
    done.returncode, done.stdout, done.stderr    # subprocess.TimeoutExpired past the timeout
"""

from __future__ import annotations

import os
import signal
import subprocess


def run_in_own_group(
    argv: list[str], timeout: float, env: dict | None = None
) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own; env: variables set beside this process's."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=None if env is None else {**os.environ, **env},
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
