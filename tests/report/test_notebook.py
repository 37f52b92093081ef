"""notebooks/analysis.ipynb runs top to bottom on the quickstart's store and draws what the run measured."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from tests.report.conftest import REPO, Quickstart

pytestmark = pytest.mark.slow


def outputs(cell: nbformat.NotebookNode) -> tuple[str, list[str]]:
    """(printed text, MIME types of displayed data) of one executed cell."""
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    kinds = [kind for o in cell.outputs if o.output_type in ("display_data", "execute_result") for kind in o.data]
    return text, kinds


def test_the_analysis_notebook_runs_on_the_quickstart_store(quickstart: Quickstart) -> None:
    notebook = nbformat.read(REPO / "notebooks" / "analysis.ipynb", as_version=4)
    settings = notebook.cells[1]
    assert settings.source.splitlines()[1] == 'DB = "lab.db"'  # the first code cell says where the store is
    settings.source = settings.source.replace('DB = "lab.db"', f'DB = "{quickstart.db}"')
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(quickstart.directory)}}).execute()

    ladder = quickstart.ladder
    measured = {name for name, _ in ladder.instruments.sections()}
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert outputs(code[1])[0].startswith(f"run qs (ladder {ladder.name}, done)")
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
