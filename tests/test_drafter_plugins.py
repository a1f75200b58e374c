"""Drafters as plugins: --draft KIND:SPEC, and the third-party drafter of docs/plugins.md installed as a real
distribution (a dist-info on sys.path, found by importlib.metadata), discovered, listed and generating."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import tomllib
from pathlib import Path

import pytest

from graft_cli.core import discovery
from graft_cli.core import DraftSettings, GraftError, PruneSchedule
from graft_cli.method import builder as methods
from graft_cli.core import DrafterEnv
from graft_cli.method.config import parse_draft
from graft_cli.method.builder import load_drafter
from graft_cli.runtime.engine import decode
from graft_cli.runtime.loading import Loaded
from graft_cli.method.builder import MethodConfig
from graft_cli.runtime.sampling import Sampling
from graft_cli.bench.synthetic import save_model_dir, word_tokenizer
from graft_cli.runtime.target import Target
from tests.test_cli import run_main
from tests.test_plugins import doc_package
from tests.tiny import tiny_model

PROMPT = "t7 t7 t7 t7 t7 t3 t7 t7"


def install_dist(site: Path, name: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]) -> None:
    """What `pip install` leaves behind for a distribution: its modules and a dist-info (METADATA,
    entry_points.txt), enough for importlib.metadata to find it as installed."""
    for module, source in modules.items():
        (site / f"{module}.py").write_text(source)
    info = site / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in entry_points.items()))


@pytest.fixture
def echo_installed(tmp_path, monkeypatch):
    """The doc's drafter (its pyproject and module taken from the doc itself) and a broken drafter, installed."""
    blocks = doc_package("A complete third-party drafter")
    project = tomllib.loads(blocks["toml"])["project"]
    site = tmp_path / "site"
    site.mkdir()
    install_dist(site, project["name"], project["entry-points"], {"graft_echo": blocks["python"]})
    install_dist(site, "graft-broken-drafter", {discovery.DRAFTERS: {"broken": "graft_broken_drafter:make"}},
                 {"graft_broken_drafter": "raise RuntimeError('this drafter is broken')\n"})
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site


@pytest.fixture
def tiny_dir(tmp_path):
    return save_model_dir(tmp_path / "tiny", tiny_model(seed=0), word_tokenizer())


def generate(capsys, model: Path, *flags: str) -> str:
    code, out, err = run_main(["generate", "--model", str(model), "--raw", "-p", PROMPT, "-n", "24", *flags], capsys)
    assert code == 0, err
    return out


def test_the_doc_drafter_installs_and_generates_exactly_what_ar_does(echo_installed, tiny_dir, capsys):
    found = discovery.discover(discovery.DRAFTERS)
    assert found["echo"].package == "graft-echo" and found["echo"].version == "0.1.0"  # real installed metadata
    assert {"model", "eagle3"} <= set(found)
    assert parse_draft("echo:3") == ("echo", "3")

    plain = generate(capsys, tiny_dir, "--method", "ar")
    assert generate(capsys, tiny_dir, "--method", "graft", "--draft", "echo:3", "--budget", "6") == plain
    assert generate(capsys, tiny_dir, "--method", "dense", "--draft", "echo:2", "--depth", "2") == plain

    # the same through the API, token by token, and the drafter really drafted
    model = tiny_model(seed=0)
    loaded = Loaded(model, word_tokenizer(), tiny_dir, "tiny")
    prompt = [int(w[1:]) for w in PROMPT.split()]
    proposer = methods.build(MethodConfig("dense", 6, draft="echo:3", drafting=DraftSettings(depth=3)), loaded)
    ar = [t for s in decode(Target(model), methods.build(MethodConfig("ar"), loaded), prompt, Sampling(), 24, set()) for t in s]
    assert [t for s in decode(Target(model), proposer, prompt, Sampling(), 24, set()) for t in s] == ar
    assert proposer.trace and all(r["draft"] == 3 and r["levels"] == 3 for r in proposer.trace)


def test_a_bad_drafter_or_spec_is_one_line_before_the_model_loads(echo_installed, tiny_dir, capsys):
    for flags, message in [
        (["--draft", "eagel3:x"], "unknown drafter kind 'eagel3' (installed: broken, eagle3, echo, model; "
                                  "did you mean eagle3:x?)"),
        (["--draft", "hf:Qwen/Qwen2.5-0.5B"], "unknown drafter kind 'hf'"),
        (["--draft", "eagle3:"], "nothing after 'eagle3:'"),
        (["--draft", "broken:1"], "drafter plugin 'broken' (graft_broken_drafter:make) failed to load"),
        (["--draft", "echo:many"], "--draft echo:N takes a number, not 'many'"),
    ]:
        code, _, err = run_main(["generate", "--model", str(tiny_dir), "-p", "t1", "--method", "dense", *flags], capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    # the kind is checked before any model loads: a model that does not exist is never reached
    code, _, err = run_main(["generate", "--model", "no-such-model", "-p", "t1", "--draft", "eagel3:x"], capsys)
    assert code == 2 and "eagel3" in err and "no-such-model" not in err
    questions = tiny_dir.parent / "questions.jsonl"
    questions.write_text('{"question_id": 1, "category": "chat", "turns": ["t1 t2"]}\n')
    code, _, err = run_main(["bench", "--model", "no-such-model", "--dataset", str(questions), "--methods", "graft",
                             "--draft", "eagel3:x"], capsys)
    assert code == 2 and "unknown drafter kind 'eagel3'" in err


def test_a_kind_counts_only_when_installed_so_paths_and_names_stay_draft_models(tmp_path, monkeypatch):
    assert parse_draft("qwen2.5-coder-0.5b-instruct") == ("model", "qwen2.5-coder-0.5b-instruct")
    assert parse_draft("eagle3:heads/run") == ("eagle3", "heads/run")
    assert parse_draft("eagle3:C:/heads:1") == ("eagle3", "C:/heads:1")  # only the first ':' splits
    assert parse_draft("model:eagle3:odd-dir") == ("model", "eagle3:odd-dir")
    for path in ["/models/a:b", "./a:b", "C:\\models\\draft", "~/m:1"]:  # a path, not a kind
        assert parse_draft(path) == ("model", path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local:draft").mkdir()  # an existing directory whose name looks like KIND:SPEC
    assert parse_draft("local:draft") == ("model", "local:draft")
    for bad, message in [("local:other", "unknown drafter kind 'local'"), ("", "--draft is empty"),
                         ("model:", "nothing after 'model:'")]:
        with pytest.raises(GraftError, match=re.escape(message)):
            parse_draft(bad)
    monkeypatch.setattr(discovery, "entry_points", lambda **params: importlib.metadata.EntryPoints(()))
    with pytest.raises(GraftError, match=r"built-in drafters are not registered .*reinstall graft"):
        parse_draft("qwen2.5-coder-0.5b-instruct")  # a stale install says so, not "unknown drafter 'model'"


def test_the_builtin_factories_take_the_env(monkeypatch):
    """`model` loads --draft through graft_cli.runtime.loading (so graft bench's shared copy is used) on the target's
    device and dtype, with the env's tree settings."""
    from graft_cli.runtime import loading
    from plugins.draft_model import DraftModelDrafter

    target = Loaded(tiny_model(seed=1), word_tokenizer(), Path("."), "tiny")
    asked = []

    def load_model(spec, device="auto", dtype="auto", device_map=None):
        asked.append((spec, device, dtype))
        return Loaded(tiny_model(seed=2), word_tokenizer(), Path("."), spec)

    monkeypatch.setattr(loading, "load_model", load_model)
    prune = PruneSchedule.default()
    drafter = load_drafter("model", DrafterEnv(target, "a:b", DraftSettings(depth=3, draft_top_k=2, draft_window=0, draft_weights="full"), prune))
    assert isinstance(drafter, DraftModelDrafter) and asked == [("a:b", "cpu", "float32")]
    assert (drafter.depth, drafter.top_k, drafter.prune, drafter.chain) == (3, 2, prune, False)


def test_plugins_list_shows_drafters_and_where_they_come_from(echo_installed, capsys):
    code, out, _ = run_main(["plugins", "list", "--json"], capsys)
    rows = {(r["kind"], r["name"]): r for r in map(json.loads, out.splitlines())}
    assert code == 0 and ("retriever", "prompt") in rows
    assert rows[("drafter", "model")]["module"] == "plugins.draft_model:make"
    assert rows[("drafter", "eagle3")]["module"] == "plugins.eagle3:make"
    echo = rows[("drafter", "echo")]
    assert (echo["package"], echo["version"], echo["ok"]) == ("graft-echo", "0.1.0", True)
    assert not rows[("drafter", "broken")]["ok"]
    code, table, _ = run_main(["plugins", "list"], capsys)
    assert code == 0 and "drafter" in table and "graft-echo" in table
