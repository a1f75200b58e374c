import importlib.metadata
import os
import tomllib
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

from graft_cli.core import discovery

# the tests' own model saving and loading print no progress bars or warnings into the output they check (graft's
# commands quiet transformers themselves: graft_cli/cli/__init__.py)
hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

# fp32 is the tests' reference on every CPU: `--dtype auto` would pick bf16 where the CPU has its units, and the
# tests' expected tokens are fp32's (set here, before any test, so the commands the tests start inherit it too);
# tests of the automatic choice unset it
os.environ["GRAFT_DTYPE"] = "float32"


@pytest.fixture(autouse=True)
def _threads(request, monkeypatch):
    """Tiny models run fastest on one thread (also where a command sets its own default, which follows
    OMP_NUM_THREADS); real-model tests get the machine's cores."""
    before = torch.get_num_threads()
    if request.node.get_closest_marker("real_model") is None:
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _declared_entry_points():
    """An editable install's entry points are those of its last `pip install -e` (`make install`): one made
    before pyproject.toml declared an entry point lacks it. The tests then see pyproject's own declarations on
    top of the installed ones, so they test the code as it installs; a fresh install makes this a no-op.
    tests/test_drafter_plugins.py goes through real installed metadata."""
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]
    installed = discovery.entry_points

    def entry_points(**params):
        found = installed(**params)
        group = params.get("group")
        missing = [importlib.metadata.EntryPoint(name, value, group)
                   for name, value in declared.get(group, {}).items() if name not in found.names]
        return importlib.metadata.EntryPoints([*found, *missing]) if missing else found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(discovery, "entry_points", entry_points)
        yield
