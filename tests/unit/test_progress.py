"""Progress bars report in plain lines where output is not a terminal (a log file, a SLURM job)."""

from rich.progress import MofNCompleteColumn, TextColumn

from sparsebalance_pl.progress import LoggedProgress


def test_off_a_terminal_a_line_per_interval_and_one_when_done(capsys):
    with LoggedProgress(TextColumn("work {task.description}"), MofNCompleteColumn(), interval=3600) as bar:
        task = bar.add_task("a", total=3)
        for _ in range(3):
            bar.advance(task)
    with LoggedProgress(TextColumn("work {task.description}"), interval=0.0, transient=True) as bar:
        task = bar.add_task("b", total=2)
        for _ in range(2):
            bar.update(task, advance=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("work") and "elapsed" in line]
    assert [line.split(",")[0] for line in lines] == ["work a: 3/3", "work b: 1/2", "work b: 2/2"]
