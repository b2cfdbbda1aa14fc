"""A checkpoint's files written while training goes on: one write at a time on a thread of the
rank's own.

    writer = BackgroundWriter()          # owned by the runner
    # returns at once; the arguments are host copies the step never touches
    writer.start(write_files, ...)
    writer.done                          # has it finished (without waiting)?
    # blocks; None, or the OSError (or other error) the write raised
    problem = writer.wait()
    writer.close()                       # waits, at the end of the run

The thread is a daemon: a process that dies mid-write leaves a temporary directory, which no load
chooses.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class BackgroundWriter:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[..., Any], *args: Any) -> None:
        if self._thread is not None:
            raise RuntimeError(
                "a background checkpoint write is still pending; wait() for it first"
            )

        def run() -> None:
            try:
                write(*args)
            # handed to wait(), which the runner reports in one line
            except BaseException as e:
                self._error = e

        self._error = None
        self._thread = threading.Thread(target=run, name="fmeg-checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> bool:
        """Whether a write was started and not yet waited for."""
        return self._thread is not None

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> BaseException | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error

    def close(self) -> None:
        self.wait()
