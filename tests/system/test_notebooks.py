"""The notebooks run top to bottom, and are committed with their outputs."""

import nbclient
import nbformat
import pytest
from support import paths

NOTEBOOKS = sorted(paths.NOTEBOOKS.glob("*.ipynb"))


def test_the_notebooks_exist():
    assert [p.stem for p in NOTEBOOKS] == [
        "autocast",
        "locate_nonfinite",
        "porting_pytorch_amp",
        "quickstart",
        "why_loss_scaling",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_with_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code
    assert all(cell.execution_count is not None for cell in code)
    assert not any(output.output_type == "error" for cell in code for output in cell.outputs)
    assert any("image/png" in output.get("data", {}) for cell in code for output in cell.outputs)


def _marked(path):
    # the porting notebook runs PyTorch beside jaxscale
    marks = [pytest.mark.slow]
    if "import torch" in path.read_text():
        marks.append(pytest.mark.torch)
    return pytest.param(path, marks=marks, id=path.stem)


@pytest.mark.parametrize("path", [_marked(path) for path in NOTEBOOKS])
def test_executes(path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError on any failing cell
