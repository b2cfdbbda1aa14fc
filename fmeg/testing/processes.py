"""A command run in a process group of its own, the whole group and every process below it killed
when it ends: torchrun's workers (each in a session of its own) never outlive the run that started
them, whether it finished, failed, timed out or the caller was stopped.

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
        kill_tree(proc.pid, proc)
        proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def kill_tree(pid: int, proc: subprocess.Popen | None = None, grace: float = 10) -> None:
    """SIGKILL to pid's process group and to every process descended from pid. torchrun starts
    each worker in a session of its own, so the group alone would leave the workers running; the
    tree is read before anything is killed, while the parent links still lead to pid. With proc
    (pid's Popen) still running, it is sent SIGTERM first and given `grace` seconds to stop its
    own (fmeg.launch forwards it to the workers and removes its temporary directories)."""
    tree = _descendants(pid)
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    for each in tree:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _descendants(pid: int) -> list[int]:
    """Every live process below pid, from /proc's parent links (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the name, in parentheses, may hold spaces: the fields follow the last ")"
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        each = todo.pop()
        found.append(each)
        todo += children.get(each, [])
    return found
