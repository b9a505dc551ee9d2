"""run.py's console: a warning repeated per mode and task is printed once per run; INFO and new warnings pass."""
from __future__ import annotations

import io
import logging

from kvtransfer.runner.console import OncePerRun, warn_once_per_run


def test_a_repeated_warning_is_printed_once_and_counted():
    stream = io.StringIO()
    logger = logging.getLogger("kvt-test-console")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        once = warn_once_per_run(logger)
        assert warn_once_per_run(logger) is not once and len(handler.filters) == 1   # no second filter
        for mode in ("target", "transfer", "no_context"):
            logger.warning("generation_kwargs: %s specified through cli", {"max_gen_toks": 16})
            logger.info("running %s", mode)
        logger.warning("another warning")
        lines = stream.getvalue().splitlines()
        assert lines.count("generation_kwargs: {'max_gen_toks': 16} specified through cli") == 1
        assert [line for line in lines if line.startswith("running")] == ["running target", "running transfer",
                                                                         "running no_context"]
        assert "another warning" in lines
        assert once.suppressed == {"generation_kwargs: {'max_gen_toks': 16} specified through cli": 2}
        assert isinstance(handler.filters[0], OncePerRun)
    finally:
        logger.removeHandler(handler)
