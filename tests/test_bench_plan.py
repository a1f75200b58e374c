"""graft bench's plan: which columns run (ar first, budgets expanded, variants under their own names) and the
MethodConfig each one is built from (--method-opt, a variant's own settings and retriever options)."""

from __future__ import annotations

import pytest

from graft_cli.bench.plan import MethodSpec, Variant, method_config, plan_methods
from graft_cli.core import GraftError


def test_plan_methods_puts_ar_first_and_expands_budgets():
    specs = plan_methods(["pld", "hf"], ["ar", "pld", "graft"], [4, "auto"])
    assert [(s.name, s.budget) for s in specs] == [("ar", None), ("pld@4", 4), ("pld@auto", "auto"), ("hf", None)]
    assert [s.name for s in plan_methods(["graft", "ar"], ["ar", "graft"], [8])] == ["ar", "graft"]
    with pytest.raises(GraftError, match="unknown method nope"):
        plan_methods(["nope"], ["ar"], [])


def test_method_opts_set_method_config_fields_by_type():
    spec = MethodSpec("pld@4", "pld", "engine", 4)
    config = method_config(spec, {"datastore": "x"}, "draft-model", {"retrievers": "prompt,recycling"})
    assert config.budget == 4 and config.options == {"datastore": "x"} and config.retrievers == ["prompt", "recycling"]
    assert method_config(MethodSpec("ar", "ar", "engine"), {}, None, {"retrievers": "x"}).retrievers is None
    with pytest.raises(GraftError, match="not a method setting"):
        method_config(spec, {}, None, {"nope": "1"})


def test_variants_run_as_named_methods_with_their_own_settings():
    variants = {"deep": Variant("graft", {"depth": "14"})}
    specs = plan_methods(["dense", "deep"], ["ar", "dense", "graft"], [16, "auto"], variants)
    assert [s.name for s in specs] == ["ar", "dense@16", "dense@auto", "deep@16", "deep@auto"]
    assert specs[3].method == "graft" and specs[3].as_dict()["opts"] == {"depth": "14"}
    assert "opts" not in specs[1].as_dict()  # fingerprints of plain methods stay as they were
    config = method_config(specs[3], {}, "draft", {"depth": "6", "draft_top_k": "3"})
    assert (config.method, config.drafting.depth, config.drafting.draft_top_k) == ("graft", 14, 3)  # the variant wins over --method-opt
    cached = plan_methods(["c"], ["ar", "graft"], [], {"c": Variant("graft", {"responses.factor": "1"})})[-1]
    assert method_config(cached, {"datastore": "x"}, None, {}).options == {"datastore": "x", "responses.factor": "1"}
    with pytest.raises(GraftError, match="name of a method"):
        plan_methods(["graft"], ["ar", "graft"], [], {"graft": Variant("graft", {})})
    with pytest.raises(GraftError, match="not an engine method"):
        plan_methods(["x"], ["ar", "graft"], [], {"x": Variant("hf", {})})


def test_a_variant_may_bring_its_own_drafter():
    """graft with a head and graft without it, side by side in one run."""
    variants = {"head": Variant("graft", {"draft": "eagle3:some-head"})}
    plain, head = plan_methods(["graft", "head"], ["ar", "graft"], [], variants)[1:]
    assert method_config(plain, {}, None).draft is None and method_config(head, {}, None).draft == "eagle3:some-head"
    assert method_config(head, {}, "model:other").draft == "eagle3:some-head"  # its own wins over --draft
    with pytest.raises(GraftError, match="not a method setting"):
        method_config(plain, {}, None, {"draft": "eagle3:x"})  # --method-opt does not set it for every method


def test_variant_flag_is_parsed_and_bad_ones_are_one_line_errors():
    from graft_cli.cli.bench import _variant

    assert _variant("deep=graft depth=14 prune_at=0:0.5,floor:0.3") == (
        "deep", Variant("graft", {"depth": "14", "prune_at": "0:0.5,floor:0.3"}))
    for bad in ["", "deep", "=graft", "deep=graft depth"]:
        with pytest.raises(GraftError):
            _variant(bad)
