"""What a person sees while a run runs: each distinct log warning once per run, not once per mode and task."""
from __future__ import annotations

import logging


class OncePerRun(logging.Filter):
    """A logging filter that passes a WARNING-or-above record only the first time its (logger, message) is seen;
    records below WARNING (progress, INFO) always pass. `suppressed` counts what it held back, per message."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()
        self.suppressed: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.getMessage())
        if key in self.seen:
            self.suppressed[key[1]] = self.suppressed.get(key[1], 0) + 1
            return False
        self.seen.add(key)
        return True


def warn_once_per_run(logger: logging.Logger | None = None) -> OncePerRun:
    """Attach one OncePerRun filter to every handler of `logger` (default: the root logger, where Hydra's and
    lm-eval's records end up) and return it. Safe to call again: a handler gets at most one such filter."""
    logger = logger or logging.getLogger()
    once = OncePerRun()
    for handler in logger.handlers:
        if not any(isinstance(f, OncePerRun) for f in handler.filters):
            handler.addFilter(once)
    return once
