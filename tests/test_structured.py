"""Structured output: a grammar's mask at every node along its own path gives plain masked decoding's tokens
(greedy and seeded) whatever the tree holds, where the mask prunes nodes and where it forces them."""

from __future__ import annotations

import json
import sys
from itertools import count
from time import perf_counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from graft_cli.core import ROOT, GraftError, Tree
from graft_cli.grammar import COPIED, FORCED, CopiedValues, GrammarConstraint, GrammarTokenizer, json_schema, regex
from graft_cli.runtime.engine import decode
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from tests.bench_fixtures import run_cli, tiny_dir  # noqa: F401 - tiny_dir: the fixture
from tests.test_device import READS
from tests.tiny import OracleTreeProposer, StaticProposer, tiny_smollm2

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "city": {"enum": ["Paris", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
STOP = 2  # the tiny model's end of text


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = tiny_smollm2()
    return model, tokenizer, GrammarTokenizer(tokenizer, 49152, {STOP})


class Empty(StaticProposer):
    def propose(self, context) -> Tree:
        return Tree()


def run(tiny, grammar, proposer, sampling=Sampling(), seed=0, n=40, drafts=True, target=Target):
    model, tokenizer, grammar_tokenizer = tiny
    prompt = tokenizer.encode("Extract the person: Ada, 36, from Oslo.")
    constraint = GrammarConstraint(grammar, grammar_tokenizer, perf_counter, drafts, prompt)  # values copied too
    steps = decode(target(model), proposer, prompt, sampling, n, {STOP}, seed, constraint=constraint)
    return [t for step in steps for t in step], constraint


@torch.inference_mode()
def masked_reference(tiny, grammar, n=40) -> list[int]:
    """Plain decoding written out: the whole sequence through the model each step, the grammar's mask, argmax."""
    model, tokenizer, grammar_tokenizer = tiny
    matcher = grammar_tokenizer.matcher(grammar)
    ids = tokenizer.encode("Extract the person: Ada, 36, from Oslo.")
    out: list[int] = []
    while len(out) < n:
        logits = model(torch.tensor([ids + out])).logits[0, -1]
        bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits[:, None] >> torch.arange(8)) & 1).flatten()[: logits.shape[0]].bool()
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        if token == STOP:
            break
        assert matcher.consume_token(token)
    return out


@pytest.mark.parametrize("shape", ["deep", "wide", "random", "mixed"])
def test_trees_under_a_schema_give_plain_masked_decoding(tiny, shape):
    grammar = json_schema(PERSON)
    truth = masked_reference(tiny, grammar)
    plain, _ = run(tiny, grammar, Empty(), drafts=False)
    assert plain == truth
    prompt_len = len(tiny[1].encode("Extract the person: Ada, 36, from Oslo."))
    graft, constraint = run(tiny, grammar, OracleTreeProposer(truth, prompt_len, 3, shape, 49152))
    assert graft == truth
    text = tiny[1].decode([t for t in truth if t != STOP])
    if truth[-1] == STOP:  # a finished answer is valid JSON of the schema's shape
        assert set(json.loads(text)) == {"name", "age", "city"}
        assert constraint.complete


def test_sampled_text_is_the_same_for_a_seed_with_any_tree(tiny):
    grammar = regex(r"(yes|no), because [a-z ]{3,30}\.")
    sampling = Sampling(temperature=0.9, top_k=50)
    plain, _ = run(tiny, grammar, Empty(), sampling, seed=7, drafts=False)
    prompt_len = len(tiny[1].encode("Extract the person: Ada, 36, from Oslo."))
    for shape in ("wide", "random"):
        graft, _ = run(tiny, grammar, OracleTreeProposer(plain, prompt_len, 5, shape, 49152), sampling, seed=7)
        assert graft == plain


class Transfers(TorchFunctionMode):
    """Counts graft's host-to-device copies (``copy_``, ``to`` a device) and its device-to-host reads (as
    tests/test_device.py's Discipline counts them)."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads, self.reads = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        where = sys._getframe(1).f_code.co_filename
        # the noise ring's copies (device_accept.py) are device to device: its rows are drawn on the device
        if "graft_cli/" in where and not where.endswith("device_accept.py"):
            self.reads += name in READS
            self.uploads += name == "copy_" or (name == "to" and "cpu" not in map(str, (*args[1:], *kwargs.values())))
        return func(*args, **kwargs)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_k=20)], ids=["greedy", "sampled"])
def test_the_fixed_shape_path_takes_the_masks_in_its_one_upload(tiny, sampling):
    """On the fixed-shape path a constrained step's masks ride in the inputs' one copy and are applied by the
    acceptance region: the eager path's tokens, one upload and one read a step."""
    from graft_cli.runtime.fixed_target import make_target

    model, tokenizer, grammar_tokenizer = tiny
    grammar, prompt = json_schema(PERSON), tokenizer.encode("Extract the person: Ada, 36, from Oslo.")
    truth, _ = run(tiny, grammar, Empty(), sampling, seed=3, drafts=False)
    proposer = OracleTreeProposer(truth, len(prompt), 4, "mixed", 49152)
    constraint = GrammarConstraint(grammar, grammar_tokenizer, perf_counter, True, prompt)
    steps = decode(make_target(model, "on"), proposer, prompt, sampling, 40, {STOP}, 3, constraint=constraint)
    got, counts, mode = list(next(steps)), [], Transfers()
    with mode:
        for new in steps:
            got += new
            counts.append((mode.uploads, mode.reads))
            mode.uploads, mode.reads = 0, 0
    assert got == truth
    assert len(counts) > 3 and set(counts) == {(1, 1)}


def test_the_mask_prunes_rejected_nodes_and_their_subtrees(tiny):
    _, tokenizer, grammar_tokenizer = tiny
    constraint = GrammarConstraint(regex(r"[0-9]{4}"), grammar_tokenizer, perf_counter, drafts=False)
    tree = Tree()
    digit = tree.add(ROOT, tokenizer.convert_tokens_to_ids("1"), "d", 0.9)
    tree.add(digit, tokenizer.convert_tokens_to_ids("9"), "d", 0.8)
    letter = tree.add(ROOT, tokenizer.convert_tokens_to_ids("a"), "d", 0.7)
    tree.add(letter, tokenizer.convert_tokens_to_ids("1"), "d", 0.6)
    shaped = constraint.shape(tree)
    assert tokenizer.decode(shaped.tokens()) == "19"
    masked = constraint.masked(shaped, torch.zeros(3, 49152))
    allowed = [tokenizer.decode(torch.nonzero(row > float("-inf")).flatten()[:3]) for row in masked]
    assert all(text and text.isdigit() for text in allowed[:2])


def test_forced_tokens_extend_the_root_and_the_drafted_paths(tiny):
    _, tokenizer, grammar_tokenizer = tiny
    constraint = GrammarConstraint(json_schema(PERSON), grammar_tokenizer, perf_counter)
    shaped = constraint.shape(Tree())
    assert tokenizer.decode(shaped.tokens()) == '{"name": "'  # the whole forced string, its last token too
    assert {node.source for node in shaped.nodes} == {FORCED}
    constraint.advance(tokenizer.encode('{"name": "Ada"'))
    drafted = Tree()
    drafted.add_path(tokenizer.encode(", "), [0.5] * len(tokenizer.encode(", ")), "draft")
    extended = constraint.shape(drafted)
    paths = [tokenizer.decode([extended.nodes[i].token for i in path]) for path in extended.paths()]
    assert sum(path.startswith(', "age":') for path in paths) == 2  # under the root, and after the drafted ", "


def test_forced_and_copied_nodes_are_priced_with_the_proposers(tiny):
    """Nodes the grammar adds (here copied ones, a guess) are cut with the proposer's, best first, to the count
    its cost model pays for."""
    _, tokenizer, grammar_tokenizer = tiny
    prompt = tokenizer.encode("Extract the person: Dr. Helena Marsh, 52, moved from Cork to Lisbon.")
    constraint = GrammarConstraint(json_schema(PERSON), grammar_tokenizer, perf_counter, prompt=prompt)
    constraint.advance(tokenizer.encode('{"name": "Hel'))
    drafted = Tree()
    drafted.add_path(tokenizer.encode("ena"), [0.9] * len(tokenizer.encode("ena")), "draft")
    drafted.add_path(tokenizer.encode("ga"), [0.1] * len(tokenizer.encode("ga")), "draft")
    whole = constraint.shape(drafted)
    assert {node.source for node in whole.nodes} == {COPIED, "draft"}
    asked = []
    cut = constraint.shape(drafted, lambda scores: asked.append(list(scores)) or 4)
    assert asked == [sorted(asked[0], reverse=True)] and len(asked[0]) == len(whole)  # every node, best first
    assert len(cut) == 4 and all(node.score >= 0.5 for node in cut.nodes)  # the 0.1 guess went first


def test_a_grammar_compiles_once_and_each_matcher_starts_fresh(tiny, monkeypatch):
    import llguidance

    _, tokenizer, grammar_tokenizer = tiny
    grammar = regex(r"[0-9]{4} once")  # a grammar no other test compiled on this tokenizer
    made, real = [], llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *a, **k: made.append(a) or real(*a, **k))
    grammar_tokenizer.check(grammar)  # compiled to check it: kept for the request's matcher
    first = grammar_tokenizer.matcher(grammar)
    assert first.consume_token(tokenizer.convert_tokens_to_ids("1"))
    second = grammar_tokenizer.matcher(grammar)
    assert len(made) == 1 and second.is_accepting() is False and second.compute_ff_tokens() == []
    assert second.consume_token(tokenizer.convert_tokens_to_ids("2"))  # its own state, not the first's


def test_the_end_is_all_a_finished_grammar_allows_and_costs_no_forward(tiny):
    _, tokenizer, grammar_tokenizer = tiny
    ticks = count()
    constraint = GrammarConstraint(regex("(yes|no)"), grammar_tokenizer, lambda: float(next(ticks)))
    assert constraint.ending() == []
    constraint.advance(tokenizer.encode("yes"))
    assert constraint.ending() == [STOP]  # the loop emits it without verifying it
    masked = constraint.masked(Tree(), torch.zeros(1, 49152))
    assert torch.nonzero(masked[0] > float("-inf")).flatten().tolist() == [STOP]
    assert constraint.seconds == 2.0  # on the clock it was handed: advance and masked, one tick each


@pytest.mark.parametrize("make, bad", [(json_schema, '{"type": "objec"}'), (json_schema, "{not json"),
                                       (regex, "[a-")])
def test_a_bad_schema_or_pattern_is_one_line(make, bad):
    with pytest.raises(GraftError) as error:
        make(bad)  # before any model loads
    assert "\n" not in str(error.value) and str(error.value).startswith("invalid")


def test_the_command_line_answers_a_schema_or_says_it_is_cut(tiny_dir, tmp_path, capsys):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    base = ["generate", "Ada, 36, Oslo", "--model", str(tiny_dir), "--device", "cpu", "--json-schema", str(schema)]
    code, out, _ = run_cli([*base, "-n", "200"], capsys)
    assert code == 0 and set(json.loads(out)) == {"name", "age", "city"}
    code, out, err = run_cli([*base, "-n", "3"], capsys)
    assert code == 1 and "incomplete" in err and out.startswith("{")
    code, _, err = run_cli(["generate", "x", "--model", str(tiny_dir), "--regex", "[a-"], capsys)
    assert code == 2 and err.count("\n") == 1 and "invalid regular expression" in err
    (tmp_path / "bad.json").write_text('{"type": "objec"}')
    code, _, err = run_cli(["generate", "x", "--json-schema", str(tmp_path / "bad.json")], capsys)
    assert code == 2 and err.count("\n") == 1 and "invalid JSON schema" in err


@pytest.mark.real_model
def test_smollm2_answers_the_schema_with_every_method_alike():
    """The default model, end to end through the API: graft's constrained answer is ar's, and valid JSON."""
    from graft_cli.api import load

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = "Extract the person as JSON: Maria Lopez is a 34-year-old nurse from Madrid."
    answers = {}
    for method in ("ar", "graft"):
        with load("smollm2-135m-instruct", method=method, device="cpu", dtype="float32") as generator:
            answers[method] = generator.generate(prompt, json_schema=schema, max_new_tokens=40)
    assert answers["graft"].token_ids == answers["ar"].token_ids
    assert answers["graft"].finish_reason == "stop" and set(json.loads(answers["graft"].text)) == {"name", "age"}
    assert answers["graft"].stats.accepted["forced"] > 0


def test_a_value_copied_from_the_prompt_is_drafted_as_the_string_writes_it(tiny):
    _, tokenizer, grammar_tokenizer = tiny
    prompt = tokenizer.encode("Extract the person: Dr. Helena Marsh, 52, moved from Cork to Lisbon.")
    assert tokenizer.convert_tokens_to_ids("\u0120Cork") in prompt  # the prompt's ' Cork'
    written = tokenizer.encode('{"name": "Helena Marsh", "city": "C')
    copied = CopiedValues(tokenizer, prompt)
    assert copied.propose(written) == ['ork to Lisbon"', 'ork"']  # the prompt's phrase, its word, after "C"
    assert tokenizer.convert_ids_to_tokens(copied.tokens(written, 'ork"')) == ["ork", '"']  # not ' Cork'
    assert copied.propose(tokenizer.encode('{"name": "')) == []  # nothing begun: any word could follow
    assert [tokenizer.decode(copied.tokens(tokenizer.encode('{"name": "Hel'), text))
            for text in copied.propose(tokenizer.encode('{"name": "Hel'))] == ['ena Marsh"', 'ena"']
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
              "required": ["name", "city"], "additionalProperties": False}
    constraint = GrammarConstraint(json_schema(schema), grammar_tokenizer, perf_counter, prompt=prompt)
    constraint.advance(written)
    shaped = constraint.shape(Tree())
    assert [node.source for node in shaped.nodes] == [COPIED] * len(shaped)
    paths = [[shaped.nodes[i].token for i in path] for path in shaped.paths()]
    assert [tokenizer.decode(path[:-1]) for path in paths] == ['ork to Lisbon"}', 'ork"}']
    assert all(path[-1] == STOP for path in paths)  # the value, the '"}' the grammar forces after it, the end
    constraint.advance(paths[1])  # the drafts were tried and rolled back: the state is still after "C"
    assert constraint.complete
