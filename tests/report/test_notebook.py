"""notebooks/analysis.ipynb run as `jupyter execute` runs it (the kernel starting in notebooks/): on the
quickstart's SQLite store it draws what the run measured; on the same rows in a real PostgreSQL server it
shows the same tables; a store that is not there is an error that leaves no file behind."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from sqlalchemy import select

from lab.store import models as m
from lab.store.db import open_store
from tests.postgres import postgres
from tests.report.conftest import REPO, Quickstart

pytestmark = pytest.mark.slow

NOTEBOOK = REPO / "notebooks" / "analysis.ipynb"
PASSWORD = "Nb-4kd82Jq"


def execute(store: str) -> nbformat.NotebookNode:
    """The notebook executed with LAB_STORE=`store`, its kernel started in notebooks/."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute(env={**os.environ, "PYTHONPATH": str(REPO), "LAB_STORE": store})
    return notebook


def outputs(cell: nbformat.NotebookNode) -> tuple[str, list[str]]:
    """(printed text, MIME types of displayed data) of one executed cell."""
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    kinds = [kind for o in cell.outputs if o.output_type in ("display_data", "execute_result") for kind in o.data]
    return text, kinds


def tables(notebook: nbformat.NotebookNode) -> list[str]:
    """The text of every table the notebook displayed, in order."""
    return [o.data["text/plain"] for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs
            if o.output_type == "execute_result"]


@pytest.fixture(scope="module")
def on_sqlite(quickstart: Quickstart) -> nbformat.NotebookNode:
    """Executed on the quickstart's store, named by a path relative to the repository root (from notebooks/,
    where the kernel starts, the same path names nothing)."""
    before = sorted(NOTEBOOK.parent.iterdir())
    notebook = execute(os.path.relpath(quickstart.db, REPO))
    assert sorted(NOTEBOOK.parent.iterdir()) == before  # no lab.db (nor its -wal or -shm) left in notebooks/
    return notebook


def test_the_analysis_notebook_runs_on_the_quickstart_store(quickstart: Quickstart,
                                                           on_sqlite: nbformat.NotebookNode) -> None:
    settings = on_sqlite.cells[1].source
    assert 'STORE = os.environ.get("LAB_STORE", "lab.db")' in settings  # the first code cell names the store
    ladder = quickstart.ladder
    measured = {name for name, _ in ladder.instruments.sections()}
    code = [cell for cell in on_sqlite.cells if cell.cell_type == "code"]
    assert outputs(code[1])[0] == f"run qs (ladder {ladder.name}, done) from {quickstart.db.resolve()}\n"
    for instrument in ("decode", "prefill"):
        opening = f'{instrument} = cells[cells["instrument"] == "{instrument}"]'
        [cell] = [c for c in code if c.source.startswith(opening)]
        text, kinds = outputs(cell)
        if instrument in measured:
            assert "image/png" in kinds and not text
        else:
            assert text == f"no {instrument} cells in this run: its ladder has no `{instrument}` instrument\n"
    verdicts = outputs(code[-1])
    assert "text/html" in verdicts[1]
    assert "C1mnbt256" in code[-1].outputs[0].data["text/plain"]


def test_on_postgresql_the_notebook_shows_the_same_tables(quickstart: Quickstart,
                                                         on_sqlite: nbformat.NotebookNode) -> None:
    with postgres(PASSWORD) as server:
        _copy(quickstart.db, server.url())
        notebook = execute(server.url())
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert outputs(code[1])[0] == f"run qs (ladder {quickstart.ladder.name}, done) from postgresql://lab:***@127.0.0.1:{server.port}/lab\n"
    # JSON columns (a cell's params, a verdict's reasons) arrive as the same Python objects on both backends.
    assert tables(notebook) == tables(on_sqlite) and len(tables(notebook)) == 3
    shown = "".join(str(o) for cell in code for o in cell.outputs)
    assert PASSWORD not in shown


def test_a_store_that_is_not_there_is_an_error_and_no_new_file(tmp_path: Path) -> None:
    with pytest.raises(CellExecutionError) as raised:
        execute("no-such-store.db")
    error = re.sub(r"\x1b\[[0-9;]*m", "", str(raised.value))  # the traceback's colours
    assert f"StoreError: no store at {REPO / 'no-such-store.db'}; pass --db" in error
    assert not (REPO / "no-such-store.db").exists() and not (NOTEBOOK.parent / "no-such-store.db").exists()


def _copy(source: Path, url: str) -> None:
    """Every row of the SQLite store into the (new) store at `url`, table by table, as stored."""
    target = open_store(url)
    origin = open_store(str(source), read_only=True)
    try:
        with origin.engine.connect() as read, target.engine.begin() as write:
            for table in m.Base.metadata.sorted_tables:
                write.execute(table.delete())  # the new store's own schema version row
                rows = [dict(row) for row in read.execute(select(table)).mappings()]
                if rows:
                    write.execute(table.insert(), rows)
    finally:
        origin.close()
        target.close()
