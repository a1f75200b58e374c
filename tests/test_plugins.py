"""Third-party retrievers: the complete plugin of docs/plugins.md, really installed, listed and proposing in a
generation; a broken one reported without breaking the others; bad proposals dropped."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from graft_cli.core import discovery
from graft_cli.runtime.engine import decode
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from graft_cli.core import Needs, RetrieverEnv
from tests.bench_fixtures import tiny_dir  # noqa: F401 - the fixture: a tiny random model with SmolLM2's tokenizer
from tests.test_cli import run_main
from tests.tiny import tiny_model

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def doc_package(heading: str) -> dict[str, str]:
    """The code blocks of the section ``heading`` of docs/plugins.md by language (``toml``: the pyproject,
    ``python``: the module): what the tests install is exactly what the docs show."""
    section = DOC.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"```(toml|python)\n(.*?)```", section, re.S))


def install(source_dir: Path, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(source_dir)],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The doc's retriever package (its pyproject and module, taken from the doc) plus a broken one, installed by
    pip into a folder on sys.path."""
    blocks = doc_package("A complete third-party retriever")
    good = tmp_path / "graft-repeat"
    good.mkdir()
    (good / "pyproject.toml").write_text(blocks["toml"])
    module = tomllib.loads(blocks["toml"])["tool"]["setuptools"]["py-modules"][0]
    (good / f"{module}.py").write_text(blocks["python"])
    broken = tmp_path / "graft-broken"
    broken.mkdir()
    (broken / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "graft-broken"\nversion = "0.1.0"\n'
        '[project.entry-points."graft.retrievers"]\nbroken = "graft_broken:make"\n'
        '[tool.setuptools]\npy-modules = ["graft_broken"]\n'
    )
    (broken / "graft_broken.py").write_text("raise RuntimeError('this plugin is broken')\n")
    site = tmp_path / "site"
    install(good, site)
    install(broken, site)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site


def generate_jsonl(tiny_dir: Path, capsys, monkeypatch, *flags: str) -> dict:
    """One ``graft generate --jsonl`` record (text and stats) for a prompt of repeats."""
    line = json.dumps({"id": 1, "prompt": "# # # # # # # # # #"}).encode()
    code, out, err = run_main(["generate", "--model", str(tiny_dir), "--raw", "--jsonl", "-n", "24", *flags], capsys,
                              stdin=line, monkeypatch=monkeypatch)
    assert code == 0, err
    return json.loads(out)


def test_the_doc_retriever_installs_lists_and_proposes_in_a_generation(installed, tiny_dir, capsys, monkeypatch):
    code, out, _ = run_main(["plugins", "list", "--json"], capsys)
    rows = {row["name"]: row for row in map(json.loads, out.splitlines())}
    assert code == 0 and rows["repeat"]["ok"] and (rows["repeat"]["package"], rows["repeat"]["version"]) == (
        "graft-repeat", "0.1.0")
    plain = generate_jsonl(tiny_dir, capsys, monkeypatch, "--method", "ar")
    record = generate_jsonl(tiny_dir, capsys, monkeypatch, "--retrievers", "repeat", "--retriever-opt",
                            "repeat.length=6")
    assert record["text"] == plain["text"]  # a retriever changes the speed only
    assert record["stats"]["proposed"].get("repeat", 0) > 0  # its nodes were verified
    with pytest.raises(ImportError, match="broken"):
        discovery.load_factory("broken")
    retriever = discovery.load_factory("repeat")(RetrieverEnv(vocab_size=97, options={"repeat.length": "3"},
                                                              name="repeat"))
    assert retriever.length == 3


def test_plugins_list_reports_a_broken_plugin_without_failing(installed, capsys):
    from graft_cli.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plugins", "list", "--json"])
        raise SystemExit(0)
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert '"name": "broken"' in out and '"ok": false' in out and '"name": "repeat"' in out


class BadIds:
    """A plugin that proposes ids outside the vocabulary (negative, = vocab, far beyond) next to good ones."""

    name = "bad-ids"

    def start(self, prompt):
        pass

    def observe(self, step):
        pass

    def retrieve(self, context, budget):
        from graft_cli.core import ROOT, Tree

        tree = Tree()
        good = tree.add(ROOT, 7, self.name, 0.9)
        tree.add(good, -3, self.name, 0.9)  # a bad child under a good node
        bad = tree.add(ROOT, 97, self.name, 0.9)
        tree.add(bad, 7, self.name, 0.9)  # a good id under a bad one goes too
        tree.add(ROOT, 10**9, self.name, 0.9)
        return tree


class Raises(BadIds):
    name = "raises"

    def retrieve(self, context, budget):
        raise RuntimeError("lookup exploded")


def test_out_of_vocabulary_ids_are_dropped_before_the_forward():
    model = tiny_model(seed=0)
    prompt = [7, 7, 7, 7, 7]
    plain = [t for s in decode(Target(model), GraftProposer(0), prompt, Sampling(), 20, set()) for t in s]
    proposer = GraftProposer(8, [BadIds()])
    proposer.latency.points = {1: 1.0, 64: 1.0}  # verification is free: every candidate is kept
    target = Target(model)
    fed = []
    verify = target.verify
    target.verify = lambda root, tree, hidden=False: fed.append(tree.tokens()) or verify(root, tree, hidden)
    assert [t for s in decode(target, proposer, prompt, Sampling(), 20, set()) for t in s] == plain
    assert fed and all(tokens == [7] for tokens in fed)  # only the one good node, never its bad child


def test_a_retriever_that_raises_is_dropped_with_one_warning(capsys):
    model = tiny_model(seed=0)
    prompt = [7, 7, 7, 7, 7]
    plain = [t for s in decode(Target(model), GraftProposer(0), prompt, Sampling(), 20, set()) for t in s]
    proposer = GraftProposer(8, [Raises(), BadIds()])
    assert [t for s in decode(Target(model), proposer, prompt, Sampling(), 20, set()) for t in s] == plain
    err = capsys.readouterr().err
    assert err.count("retriever raises failed in retrieve()") == 1 and "lookup exploded" in err


def test_a_retriever_without_the_optional_members_gets_their_defaults():
    """A plugin may leave out ``stateless`` and ``close``: the proposer completes it once (never probing per
    step), so Graft(TAIL) skips it and closing the session works; one that has them is used as it is."""
    from graft_cli.core import RetrieverDefaults, Tree

    asked = []

    class Minimal(BadIds):  # name, start, observe, retrieve: nothing more
        name = "minimal"

        def retrieve(self, context, budget):
            asked.append(list(context))
            return Tree.from_paths([[5]], self.name, 0.9)

    class Full(RetrieverDefaults, Minimal):
        name = "full"

    class Chain:
        needs, levels = Needs(), 1

        def draft(self, context, budget):
            return Tree.from_paths([[3]], "draft", 0.9)

        def close(self):
            pass

    full = Full()
    proposer = GraftProposer(4, [Minimal(), full], drafter=Chain(), tail=True)
    assert proposer.retrievers[1] is full and not proposer.retrievers[0].stateless
    proposer.propose([1, 2])
    assert [1, 2, 3] not in asked  # only stateless retrievers continue the drafted chain
    proposer.close()
