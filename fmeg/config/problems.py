"""A list of one-line problems that checks fill: need(ok, message) adds message when ok is false."""

from __future__ import annotations

from typing import Any, Callable


class Problems(list):
    """A list of one-line problems and need(ok, message), which adds message when ok is false."""

    @classmethod
    def start(cls) -> tuple["Problems", Callable[[Any, str], None]]:
        problems = cls()
        return problems, problems.need

    def need(self, ok: Any, message: str) -> None:
        if not ok:
            self.append(message)
