"""Progress of a training job over its rounds.

On a terminal (stderr is a TTY) ``medpfl train`` shows a live bar (rich): rounds done, the
latest global and local accuracy, elapsed and remaining time, with log messages printed above
it. Anywhere else (under Snakemake the job's output goes to its log file) it writes exactly one
log line per round, as before::

    round 3/30 global_test_acc=0.812 local_bal_acc_mean=0.700 (6.6s)
"""

from __future__ import annotations

import logging
import sys
from typing import IO

#: The per-round numbers shown, in order, with their label on the bar.
SHOWN = (("global_test_acc", "global"), ("local_bal_acc_mean", "local"), ("personalized_acc_mean", "personalized"))


def use_bar(stream: IO[str] | None = None) -> bool:
    """A live bar only when ``stream`` (default: stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def round_text(scalars: dict[str, float]) -> str:
    """``global_test_acc=0.812 local_bal_acc_mean=0.700`` (the log line's numbers)."""
    return " ".join(f"{k}={scalars[k]:.3f}" for k, _ in SHOWN if k in scalars)


class RoundProgress:
    """Report each finished round: a rich bar on a terminal, else one ``log`` line per round.

    Use as a context manager around the training loop and call :meth:`update` after each round.
    ``bar``: force the mode (``None``: :func:`use_bar` on ``stream``).
    """

    def __init__(self, total: int, label: str, log: logging.Logger, stream: IO[str] | None = None,
                 bar: bool | None = None):
        self.total = total
        self.label = label
        self.log = log
        self.stream = sys.stderr if stream is None else stream
        self.bar = use_bar(self.stream) if bar is None else bar
        self._progress = None
        self._task = None
        self._first = True
        self._swapped: list[tuple[logging.StreamHandler, IO[str]]] = []

    def __enter__(self) -> "RoundProgress":
        if not self.bar:
            return self
        from rich.console import Console
        from rich.file_proxy import FileProxy
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        console = Console(file=self.stream, force_terminal=True)
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[numbers]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                  console=console, redirect_stdout=False, redirect_stderr=False)
        self._task = self._progress.add_task(f"{self.label} rounds", total=self.total, numbers="")
        self._progress.start()
        # log records keep their format but print above the bar instead of through it
        proxy = FileProxy(console, self.stream)
        for h in logging.getLogger().handlers:
            if type(h) is logging.StreamHandler and h.stream is self.stream:
                self._swapped.append((h, h.setStream(proxy)))
        return self

    def update(self, rnd: int, scalars: dict[str, float], seconds: float) -> None:
        """Round ``rnd`` (0-based) finished with these per-round numbers in ``seconds``."""
        if not self.bar:
            self.log.info("round %d/%d %s (%.1fs)", rnd + 1, self.total, round_text(scalars), seconds)
            return
        if self._first and rnd > 0:  # resumed from a checkpoint: start the clock at that round
            self._progress.reset(self._task, completed=rnd, numbers="")
        self._first = False
        numbers = "  ".join(f"{label} {scalars[k]:.3f}" for k, label in SHOWN if k in scalars)
        self._progress.update(self._task, completed=rnd + 1, numbers=f"{numbers}  ({seconds:.1f}s/round)")

    def __exit__(self, *exc) -> None:
        if self._progress is None:
            return
        for h, old in self._swapped:
            proxy = h.setStream(old)
            if proxy is not None:
                proxy.flush()
        self._swapped = []
        self._progress.stop()
        self._progress = None
