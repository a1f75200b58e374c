"""graft_cli.plugin, the one module a plugin imports: cheap for a retriever, its option rule, its API version check,
and the old names of moved modules, which keep working for a release with a warning."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import graft_cli
from graft_cli import plugin
from graft_cli.core import GraftError, Options, RetrieverEnv, version
from graft_cli.core.moved import MOVED, REMOVED_IN
from tests.test_cli import run_main
from tests.test_drafter_plugins import install_dist, tiny_dir  # noqa: F401 - tiny_dir: the fixture

ROOT = Path(__file__).resolve().parents[1]


def test_a_retriever_pays_for_no_torch_and_a_drafter_gets_its_names_on_first_use():
    code = """
import json, sys
from graft_cli.plugin import RetrieverEnv, Step, Tree, option
retriever = sorted(m for m in ("torch", "transformers", "datastores") if m in sys.modules)
from graft_cli.plugin import TreeDrafter
print(json.dumps([retriever, "torch" in sys.modules]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout) == [[], True]


def test_every_public_name_is_there_and_is_the_original():
    from graft_cli.drafting import TreeDrafter
    from graft_cli.runtime import token_ranking

    assert len(set(plugin.__all__)) == len(plugin.__all__)
    assert all(hasattr(plugin, name) for name in plugin.__all__) and set(plugin.__all__) <= set(dir(plugin))
    assert plugin.TreeDrafter is TreeDrafter and plugin.load_ranking is token_ranking.load
    with pytest.raises(AttributeError, match="no attribute 'Options'"):
        plugin.Options  # graft's own bookkeeping, not a plugin's


def test_an_option_prefixed_with_the_retrievers_name_wins_over_the_plain_key():
    options = Options({"depth": "3", "mine.depth": "5", "mine.on": "yes", "off": "0", "empty": ""})
    env = RetrieverEnv(vocab_size=9, options=options, name="mine")
    assert plugin.option(env, "depth", 8, int) == 5
    assert plugin.option(RetrieverEnv(vocab_size=9, options=options, name="other"), "depth", 8, int) == 3
    assert plugin.option(env, "missing", 8, int) == 8 and plugin.option(env, "empty", "x") == "x"
    assert plugin.option(env, "on", False, bool) is True and plugin.option(env, "off", True, bool) is False
    assert {"depth", "mine.depth", "mine.missing", "missing"} <= options.read  # neither is reported as unread
    for key, cast, kind in [("depth", float, "float"), ("on", int, "int"), ("depth", bool, "bool")]:
        bad = RetrieverEnv(vocab_size=9, options={key: "x,y"}, name="mine")
        with pytest.raises(GraftError, match=f"^retriever mine: option {key} must be a {kind}, not 'x,y'$"):
            plugin.option(bad, key, None, cast)


def test_the_api_version_check_passes_its_own_major_and_refuses_another_in_one_line():
    major, minor = plugin.API_VERSION
    plugin.require_api(major)
    plugin.require_api(major, minor)
    for asked, hint in [((major + 1, 0), "upgrade graft"), ((major, minor + 1), "upgrade graft"),
                        ((major - 1, 0), "update the plugin")]:
        with pytest.raises(GraftError, match=f"needs graft's plugin API {asked[0]}.{asked[1]} .*: {hint}$"):
            plugin.require_api(*asked)


def test_a_plugin_for_another_api_is_one_line_in_generate_and_listed_as_broken(tmp_path, monkeypatch, tiny_dir,
                                                                              capsys):
    site = tmp_path / "site"
    site.mkdir()
    install_dist(site, "graft-future", {"graft.retrievers": {"future": "graft_future:make"}},
                 {"graft_future": "from graft_cli.plugin import require_api\nrequire_api(99)\nmake = None\n"})
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    code, _, err = run_main(["generate", "--model", str(tiny_dir), "-p", "t1", "--retrievers", "future"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "retriever plugin 'future' (graft_future:make) failed to load: needs graft's plugin API 99.0" in err
    code, out, _ = run_main(["plugins", "list", "--json"], capsys)
    row = next(r for r in map(json.loads, out.splitlines()) if r["name"] == "future")
    assert code == 0 and not row["ok"] and "upgrade graft" in row["error"]


def test_an_old_name_imports_the_new_module_and_warns_at_the_import_line(monkeypatch):
    from graft_cli.core import tree

    monkeypatch.delitem(sys.modules, "graft_cli.tree", raising=False)  # another test may have imported it
    with pytest.warns(DeprecationWarning, match=r"^graft_cli.tree moved to graft_cli.core.tree; the old name goes in "
                                                r"graft 0.2.0 \(a plugin imports all it needs from graft_cli.plugin\)"
                      ) as caught:
        from graft_cli.tree import Tree
    assert Tree is tree.Tree and caught[0].filename == __file__


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_moved_name_is_its_new_module_and_no_file_of_its_own(old, monkeypatch):
    path = ROOT.joinpath(*old.split("."))
    assert not path.with_suffix(".py").exists() and not path.is_dir(), f"{old} is a real module: drop it from MOVED"
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_the_moved_names_go_in_the_release_that_table_names():
    release = lambda text: tuple(int(part) for part in text.split("."))
    assert release(version.__version__) < release(REMOVED_IN), "this release drops the old names: empty MOVED"


def test_a_missing_name_is_still_a_plain_module_not_found():
    with pytest.raises(ModuleNotFoundError, match="No module named 'graft_cli.no_such_module'"):
        importlib.import_module("graft_cli.no_such_module")
    assert sum(type(f).__name__ == "MovedFinder" for f in sys.meta_path) == 1
    importlib.reload(graft_cli)  # installed once, however often graft is imported
    assert sum(type(f).__name__ == "MovedFinder" for f in sys.meta_path) == 1
