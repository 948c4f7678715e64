"""Every notebook in notebooks/ runs top to bottom without a cell raising.

Each runs in a fresh ipykernel on this interpreter, with matplotlib's Agg
backend, on the built-in tiny model (or ``JAXRUNNER_MODEL`` where it is set);
the quickstart also runs on a HuggingFace checkpoint directory the test saves
(random Llama weights and the byte-level tokenizer), as a user with a real
checkpoint runs it (the other notebooks load their model the same way). The
kernels share one persistent compilation cache (``JAXRUNNER_COMPILATION_CACHE_DIR``),
as one user's sessions would, so each notebook compiles only what the earlier
ones did not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxrunner import envs

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
CHECKPOINT_NOTEBOOKS = [p for p in NOTEBOOKS if p.stem == "01_quickstart"]
CELL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Jupyter data dir whose python3 kernelspec starts this interpreter, whatever else is installed."""
    data_dir = tmp_path_factory.mktemp("jupyter")
    kernelspec.write_kernel_spec(data_dir / "kernels" / "python3")
    (data_dir / "xla_cache").mkdir()
    return data_dir


def run_notebook(path: Path, kernel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Execute every cell in a fresh kernel (a cell that raises fails the test); returns the printed text."""
    # JUPYTER_PATH comes first in the kernelspec search; the kernel inherits MPLBACKEND, JAXRUNNER_MODEL and
    # the compilation cache's directory.
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv(envs.COMPILATION_CACHE_DIR_ENV_VAR, str(kernel_dir / "xla_cache"))
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    return "".join(out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, kernel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_notebook(path, kernel_dir, monkeypatch)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A HuggingFace Llama checkpoint with its tokenizer, as ``save_pretrained`` writes them."""
    from hf_models import save_tiny_hf_model

    from jaxrunner.models.tokenizer import build_byte_tokenizer

    path = tmp_path_factory.mktemp("checkpoint")
    tokenizer = build_byte_tokenizer()
    save_tiny_hf_model("llama", path, seed=5, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("path", CHECKPOINT_NOTEBOOKS, ids=[p.stem for p in CHECKPOINT_NOTEBOOKS])
def test_notebook_runs_on_a_checkpoint_dir(
    path: Path, kernel_dir: Path, checkpoint_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JAXRUNNER_MODEL", str(checkpoint_dir))
    printed = run_notebook(path, kernel_dir, monkeypatch)
    assert f"model: {checkpoint_dir}" in printed
