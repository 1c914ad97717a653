"""The progress bar most commands share: a label, a bar, done/total, the current item."""

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ctseg import progress as signatures


@contextmanager
def counting(label: str) -> Iterator[signatures.Progress]:
    """A transient bar on stderr; yields the `ctseg.progress.Progress` callback
    (done, total, item) that the library functions take."""
    columns = (
        TextColumn(f"[bold]{escape(label)}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=None)

        def report(done: int, total: int, item: str) -> None:
            bar.update(task, completed=done, total=total, description=escape(str(item)))

        yield report
