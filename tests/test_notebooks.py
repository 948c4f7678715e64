"""Every notebook in notebooks/ runs top to bottom without a cell raising.

Each runs in a fresh ipykernel on this interpreter, with matplotlib's Agg
backend, on the built-in tiny model (or ``JAXRUNNER_MODEL`` where it is set).
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Jupyter data dir whose python3 kernelspec starts this interpreter, whatever else is installed."""
    data_dir = tmp_path_factory.mktemp("jupyter")
    kernelspec.write_kernel_spec(data_dir / "kernels" / "python3")
    return data_dir


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, kernel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # JUPYTER_PATH comes first in the kernelspec search; the kernel inherits MPLBACKEND.
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
