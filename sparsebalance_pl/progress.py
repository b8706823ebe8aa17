"""Progress bars for long work that also report when output goes to a file (a log, a SLURM job).

Where its console is not a terminal, rich draws a bar once, at the end: an hour's run then looks stuck in
its log. ``LoggedProgress`` is rich's bar on a terminal, and elsewhere prints a plain line about each task
every ``interval`` seconds and when it finishes.
"""

from __future__ import annotations

import time
from typing import Any

from rich.progress import Progress, TaskID, TextColumn


class LoggedProgress(Progress):
    """``rich.progress.Progress`` that, off a terminal, prints its text columns, then done/total, elapsed
    and remaining time."""

    def __init__(self, *columns: Any, interval: float = 60.0, **kwargs: Any) -> None:
        super().__init__(*columns, **kwargs)
        self.interval = interval
        self.last_report = time.monotonic()
        self.reported_done: set[TaskID] = set()

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self.report(task_id)

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        if "completed" in kwargs or "advance" in kwargs:
            self.report(task_id)

    def report(self, task_id: TaskID) -> None:
        """One plain line about the task, if output is not a terminal and it is time (or the task is done)."""
        if self.disable or self.console.is_terminal:
            return
        task = next(t for t in self.tasks if t.id == task_id)
        now = time.monotonic()
        if task_id in self.reported_done or (now - self.last_report < self.interval and not task.finished):
            return
        self.last_report = now
        if task.finished:
            self.reported_done.add(task_id)
        text = " ".join(" ".join(c.render(task).plain.split()) for c in self.columns if isinstance(c, TextColumn))
        total = "" if task.total is None else f"/{task.total:g}"
        left = task.time_remaining
        print(f"{text}: {task.completed:g}{total}, {task.elapsed or 0.0:.0f} s elapsed"
              + ("" if left is None or task.finished else f", about {left:.0f} s left"), flush=True)
