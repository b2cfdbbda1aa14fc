"""Commands of fmeg's recipes run from a warm process: torch and the recipes' modules imported once,
each run's ranks forked from it, so that a test pays a fork, not a torch import, per rank.

    pool = WarmPool(preload=["recipes.gpt_pretrain"])
    done = pool.run("recipes.gpt_pretrain", ["--train-iters", "4"], nproc=2, timeout=600)
    done.returncode, done.stdout, done.stderr          # as torchrun --standalone would give them
    pool.close()

A run of nproc ranks is what `torchrun --standalone --nproc-per-node nproc -m module args` runs:
each rank gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), the
same current directory, sys.argv and sys.path[0], and the text the preload printed on stderr (the
import-time warnings a fresh process prints). Rank 0 hosts the store (torch's env:// default), as
there is no agent. One rank failing ends the others, torchrun's way, and the run then exits 1; one
rank alone exits with its own code. What is not the same: torchrun's own lines are not printed,
and the agent's elastic restarts do not exist; tests of those start torchrun itself.

The server is one process in a session of its own; it forks nothing but the ranks of the run it
is asked for, one run at a time, and kills every process below each rank when the run ends. It
exits, killing its runs, when its client's pipe closes.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from fmeg.testing.processes import kill_tree

# torchrun's grace between a failed rank and SIGKILL of the others
_GRACE_S = 5.0
_POLL_S = 0.02


class WarmPool:
    """A server with `preload` imported, started on first use; run() as subprocess.run would
    answer for the torchrun command (subprocess.TimeoutExpired past the timeout)."""

    def __init__(self, preload: list[str], env: dict | None = None):
        self.preload, self.env = list(preload), env
        self._proc: subprocess.Popen | None = None

    def run(
        self, module: str, args: list[str], nproc: int, timeout: float, cwd: str | None = None
    ) -> subprocess.CompletedProcess:
        proc = self._server()
        with tempfile.TemporaryDirectory(prefix="fmeg-warm-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {
                "module": module,
                "args": list(args),
                "nproc": nproc,
                "timeout": timeout,
                "cwd": cwd or os.getcwd(),
                "env": dict(os.environ),
                "stdout": out,
                "stderr": err,
            }
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                self.close()
                raise RuntimeError("the warm pool's server died")
            reply = json.loads(line)
            stdout, stderr = _read(out), _read(err)
        argv = ["torchrun", f"--nproc-per-node={nproc}", "-m", module, *args]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, reply["returncode"], stdout, stderr)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            kill_tree(self._proc.pid)
            self._proc.wait()
            self._proc = None

    def _server(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            # the modules go on stdin, not argv: a per-test process reaper must not take the
            # server for one of the commands it started
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "fmeg.testing.warm_pool"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
                env=None if self.env is None else {**os.environ, **self.env},
            )
            self._proc.stdin.write(json.dumps(self.preload) + "\n")
            atexit.register(self.close)
        return self._proc


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def serve() -> None:
    """The server's loop: the modules to preload on stdin's first line, then a request a line,
    a reply a line on stdout."""
    replies = os.fdopen(os.dup(1), "w")
    requests = os.fdopen(os.dup(0), "r")
    # nothing the preload or a stray print writes may reach the protocol's pipe
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    import_text = _preload(json.loads(requests.readline()))
    for line in requests:
        reply = _run(json.loads(line), import_text, (requests.fileno(), replies.fileno()))
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _preload(modules: list[str]) -> bytes:
    """Import modules with stderr caught; what they printed there, which every rank prints again
    (a fresh process prints its import-time warnings)."""
    import importlib

    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            for name in modules:
                importlib.import_module(name)
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        return caught.read()


def _run(request: dict, import_text: bytes, protocol: tuple[int, int]) -> dict:
    """Fork the ranks, wait for them: {"returncode", "timed_out"}."""
    from fmeg.parallel.spmd import free_port

    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    out, err = os.open(request["stdout"], flags), os.open(request["stderr"], flags)
    nproc, port = request["nproc"], free_port()
    pids = []
    try:
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                os.setsid()
                for fd in protocol:
                    os.close(fd)
                os.dup2(out, 1)
                os.dup2(err, 2)
                os.write(2, import_text)
                _rank_main(request, rank, port)
            pids.append(pid)
    finally:
        os.close(out)
        os.close(err)
    try:
        return _wait(pids, request["timeout"], protocol[0], torchrun=nproc > 1)
    finally:
        for pid in pids:
            kill_tree(pid)
        for pid in pids:
            _reap(pid)


def _wait(pids: list[int], timeout: float, client_fd: int, torchrun: bool) -> dict:
    """Each rank's exit, as torchrun waits for them: the first failure ends the others (SIGTERM,
    then SIGKILL after a grace) and the run exits 1. The client's pipe closing ends them too."""
    codes: dict[int, int] = {}
    deadline, failed_at = time.monotonic() + timeout, None
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.monotonic()
                    _signal(set(pids) - set(codes), signal.SIGTERM)
        if failed_at is not None and time.monotonic() > failed_at + _GRACE_S:
            break
        if time.monotonic() > deadline:
            return {"returncode": None, "timed_out": True}
        # the client writes its next request only after this reply: readable now means closed
        if select.select([client_fd], [], [], _POLL_S)[0]:
            sys.exit(0)
    failures = [c for c in (codes.get(pid, -signal.SIGKILL) for pid in pids) if c != 0]
    if not failures:
        return {"returncode": 0, "timed_out": False}
    # a rank killed by a signal reads as subprocess gives it: minus the signal's number
    return {"returncode": 1 if torchrun else failures[0], "timed_out": False}


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _rank_main(request: dict, rank: int, port: int) -> None:
    """One rank, in the forked child: never returns."""
    import runpy
    import threading
    import traceback

    code = 1
    try:
        nproc = request["nproc"]
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if nproc > 1:
            os.environ.update(_torchrun_env(rank, nproc, port))
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        # the streams were the server's null device: bind them to the new descriptors
        sys.stdin = open(os.devnull)
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=False)
        sys.stderr = io.TextIOWrapper(
            os.fdopen(2, "wb", closefd=False), write_through=True, errors="backslashreplace"
        )
        sys.path[0] = request["cwd"]
        sys.argv = [request["module"], *request["args"]]
        sys.modules.pop(request["module"], None)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = 0
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _torchrun_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The variables torchrun --standalone gives worker `rank` (no agent store: rank 0 hosts)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": f"warm-{port}",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


if __name__ == "__main__":
    serve()
