"""EAGLE-3 heads trained on a tiny target: the loss falls, a run SIGKILLed mid-way resumes bit-exactly, the trained
head is lossless through the loop (greedy and sampled), the command line, and the shipped heads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graft_cli.heads import load_head
from graft_cli.heads import checkpoint as ckpt
from graft_cli.heads.data import Batch
from graft_cli.heads.teacher import teach
from graft_cli.heads.train import draft_config, new_head
from tests.bench_fixtures import run_cli


# --- training on a tiny target ---------------------------------------------------------------------------------

WORDS = ["red", "green", "blue", "one", "two", "three", "cat", "dog", "sun", "moon"]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A 5-layer, 32-wide random Llama with SmolLM2's tokenizer (its chat template is what data.py applies)."""
    from tests.tiny import tiny_smollm2

    model, tokenizer = tiny_smollm2(layers=5)
    # its greedy tokens and most of its mass on the corpus' own tokens, as a real model's would be
    text = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(WORDS)}], tokenize=False)
    used = torch.tensor(sorted(set(tokenizer(text + " ".join(WORDS))["input_ids"])))
    with torch.no_grad():
        weight = model.lm_head.weight
        kept = weight[used] * 4
        weight.zero_()
        weight[used] = kept
    path = tmp_path_factory.mktemp("tiny") / "tiny-smollm2"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Instruction/response records (chat-templated) and plain text, repetitive enough to learn from."""
    path = tmp_path_factory.mktemp("corpus")
    words = WORDS
    gen = torch.Generator().manual_seed(0)
    with open(path / "pairs.jsonl", "w") as f:
        for i in range(60):
            picked = [words[int(j)] for j in torch.randint(0, len(words), (6,), generator=gen)]
            f.write(json.dumps({"instruction": "Repeat: " + " ".join(picked), "response": " ".join(picked * 3)}) + "\n")
    with open(path / "text.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"text": " ".join(words[(i + j) % 10] for j in range(40))}) + "\n")
    return path


def settings(tiny_target, corpus, tmp_path, **over):
    from graft_cli.heads.train import Settings

    base = dict(model=str(tiny_target), data=[str(corpus)], run=str(tmp_path / "run"), out=str(tmp_path / "head"),
                max_steps=30, ttt=3, draft_vocab=64, seq_len=48, batch_size=2, lr=3e-3, warmup=3,
                heldout_every=8, eval_sequences=2, checkpoint_every=10, log_every=5, threads=1)
    base.update(over)
    return Settings(**base)


def final_state(run: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    latest = ckpt.latest_checkpoint(run)
    state = json.loads((latest / "state.json").read_text())
    return state, load_file(str(latest / "state.safetensors"))


@pytest.fixture(scope="module")
def trained(tiny_target, corpus, tmp_path_factory):
    from graft_cli.heads.train import train

    tmp = tmp_path_factory.mktemp("trained")
    return tmp, train(settings(tiny_target, corpus, tmp))


def test_the_loss_falls_and_the_head_loads(tiny_target, trained):
    tmp, out = trained
    state, _ = final_state(tmp / "run")
    losses = [h[2] for h in state["history"]]
    assert state["step"] == 30 and state["tokens"] == 30 * 2 * 48
    assert losses[-1] < 0.6 * losses[0], losses
    assert len(state["evals"]) == 3 and len(state["evals"][-1]["acceptance"]) == 3
    assert state["evals"][-1]["loss"] < state["evals"][0]["loss"]
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    head = load_head(str(out), target)
    assert head.cfg.draft_vocab == 64 and head.w["fc.weight"].shape == (32, 96)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["num_hidden_layers"] == 1
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 1]  # hidden_states 2, 2, 2 of 5 layers


def test_a_killed_run_resumes_bit_exactly(tiny_target, corpus, tmp_path):
    """A real subprocess, SIGKILLed after its first checkpoints, resumed: the final weights, optimiser state and
    loss history equal those of a run that was never interrupted."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from graft_cli.heads.train import train

    whole = settings(tiny_target, corpus, tmp_path / "whole", max_steps=24, checkpoint_every=2, log_every=2)
    train(whole)
    cut = settings(tiny_target, corpus, tmp_path / "cut", max_steps=24, checkpoint_every=2, log_every=2)
    argv = [sys.executable, "-m", "graft_cli", "heads", "train", "--model", cut.model, "--data", cut.data[0],
            "--run", cut.run, "--out", cut.out, "--max-steps", "24", "--ttt", "3", "--draft-vocab", "64",
            "--seq-len", "48", "--batch-size", "2", "--lr", "3e-3", "--warmup", "3", "--heldout-every", "8",
            "--eval-sequences", "2", "--checkpoint-every", "2", "--log-every", "2", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = Path(cut.run)
    deadline = time.monotonic() + 240
    try:
        while ckpt.latest_checkpoint(run) is None or ckpt.latest_checkpoint(run).name < "ckpt-00000004":
            assert proc.poll() is None and time.monotonic() < deadline, "the training subprocess ended early"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    interrupted = json.loads((ckpt.latest_checkpoint(run) / "state.json").read_text())["step"]
    assert interrupted < 24 and not Path(cut.out).exists()
    train(cut, resume=True)
    (a_state, a), (b_state, b) = final_state(Path(whole.run)), final_state(run)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert a_state["history"] == b_state["history"] and a_state["evals"] == b_state["evals"]
    assert not list(run.glob(".ckpt-*"))  # the killed run's temporaries are gone


@pytest.mark.parametrize("method", ["dense", "graft", "chain"])
def test_a_trained_head_is_lossless_through_the_loop(tiny_target, trained, method):
    from transformers import AutoModelForCausalLM

    from graft_cli.drafting.proposer import GraftProposer
    from plugins.eagle3 import Eagle3Drafter
    from graft_cli.core import PruneSchedule
    from plugins.prompt_lookup import PromptLookup
    from tests.test_eagle3 import run

    _, out = trained
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    head = load_head(str(out), target)
    prune = None if method == "dense" else PruneSchedule.parse("0:0.3,1:0.2")
    drafter = Eagle3Drafter(head, target, depth=4, top_k=2, prune=prune, chain=method == "chain")
    proposer = GraftProposer(8, [PromptLookup()] if method != "dense" else [], drafter=drafter, tail=method == "chain")
    for prompt in ([1, 2, 3, 4, 5], [30, 31, 32, 30, 31]):
        assert run(target, proposer, prompt, 24) == run(target, GraftProposer(0), prompt, 24)


def test_a_trained_head_keeps_the_sampling_distribution(tmp_path):
    """A head trained (a few steps, on a 6-token target) drafting under speculative sampling: the joint
    distribution of two generated tokens is the target's own (chi-square, as tests/test_sampling.py)."""
    from transformers import AutoModelForCausalLM

    from graft_cli.runtime import engine
    from plugins.eagle3 import Eagle3Drafter
    from graft_cli.drafting.proposer import GraftProposer
    from graft_cli.heads.train import ttt_loss
    from graft_cli.runtime.target import Target
    from tests.test_sampling import PROMPT, SETTINGS, V, chi_square_rejects, exact_joint
    from tests.tiny import tiny_model

    raw = tiny_model(seed=11, vocab=V, init=0.08).config.to_dict()
    raw.update(num_hidden_layers=5)
    raw.pop("layer_types", None)
    torch.manual_seed(11)
    target = AutoModelForCausalLM.from_config(type(tiny_model().config)(**raw), dtype=torch.float32).eval()
    head = new_head(target, draft_config(target.config, 4), torch.tensor([0, 2, 3, 5]), 0)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        tokens = torch.randint(0, V, (2, 12), generator=gen)
        batch = Batch(tokens, torch.arange(12).expand(2, 12), torch.zeros_like(tokens))
        r = ttt_loss(head, batch, teach(target, batch, head.cfg.layers, head.draft_ids(), full=False), 3, 0.8, None)
        opt.zero_grad()
        r.loss.backward()
        opt.step()
    ckpt.write_head(head, target.config, tmp_path / "h", torch.float32, {})
    sampling = SETTINGS[0]
    drafter = Eagle3Drafter(load_head(str(tmp_path / "h"), target), target, depth=2, top_k=2)
    proposer = GraftProposer(4, drafter=drafter)
    counts: dict = {}
    n = 1500
    for seed in range(n):  # one seed per run: a seed fixes the sampled text
        tokens = [t for s in engine.decode(Target(target), proposer, PROMPT, sampling, 3, set(), seed) for t in s]
        counts[(tokens[1], tokens[2])] = counts.get((tokens[1], tokens[2]), 0) + 1
    assert not chi_square_rejects(exact_joint(target, sampling), counts, n)



# --- the command line and the shipped head ---------------------------------------------------------------------


def test_bad_training_input_is_one_line(tiny_target, corpus, tmp_path, capsys):
    base = ["heads", "train", "--model", str(tiny_target), "--run", str(tmp_path / "run")]
    cases = [
        (base + ["--data", str(tmp_path / "absent"), "--out", str(tmp_path / "h")], "does not exist"),
        (base + ["--data", str(corpus), "--out", str(tmp_path / "h"), "--resume"], "no checkpoint"),
        (base + ["--data", str(corpus)], "exactly one of --out DIR or --name NAME"),
        (base + ["--data", str(corpus), "--name", "a/b"], "plain name"),
        (base + ["--data", str(corpus), "--out", str(tmp_path / "h"), "--draft-vocab", "0"], "--draft-vocab"),
    ]
    for argv, message in cases:
        code, out, err = run_cli(argv, capsys)
        assert code == 2 and message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "h").exists()


def test_named_heads_resolve_and_list(tiny_target, trained, tmp_path, monkeypatch, capsys):
    import shutil

    from graft_cli.heads import resolve_head

    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    _, out = trained
    shutil.copytree(out, tmp_path / "heads" / "mine")
    assert resolve_head("mine") == tmp_path / "heads" / "mine"
    code, listing, _ = run_cli(["heads", "list"], capsys)
    assert code == 0 and "mine\tuser" in listing
    code, _, err = run_cli(["generate", "-p", "hi", "--model", str(tiny_target), "--draft", "eagle3:nothere",
                             "--method", "dense"], capsys)
    assert code == 2 and "not a directory, a named head" in err


SHIPPED_HEADS = sorted((Path(__file__).resolve().parents[1] / "graft_cli" / "heads" / "shipped").glob("*/README.md"))


@pytest.mark.parametrize("readme", SHIPPED_HEADS, ids=[p.parent.name for p in SHIPPED_HEADS])
def test_a_shipped_head_matches_its_readme(readme):
    import re

    root = readme.parent
    digest = re.search(r"sha256: `([0-9a-f]{64})`", readme.read_text())
    assert digest and ckpt.sha256(root / "model.safetensors") == digest.group(1)
    assert (root / "model.safetensors").stat().st_size <= 25e6
    from safetensors import safe_open

    with safe_open(str(root / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys() and f.get_tensor("fc.weight").dtype == torch.bfloat16
    raw = json.loads((root / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and "draft_vocab_size" in raw


def test_regenerated_answers_are_the_targets_and_cached(tiny_target, corpus, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graft_cli.heads.data import read_documents
    from graft_cli.heads.regenerate import Regenerator

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    cache = tmp_path / "regenerated.jsonl"
    first = Regenerator(model, tokenizer, cache, max_new_tokens=6)
    docs, _ = read_documents([str(corpus / "pairs.jsonl")], tokenizer, max_documents=5, regenerate=first.answer)
    assert first.generated >= 5 and len(cache.read_text().splitlines()) == first.generated
    with open(cache, "a") as f:
        f.write('{"key": "cut sho')  # a killed run's last line
    again = Regenerator(model, tokenizer, cache, max_new_tokens=6)
    same, _ = read_documents([str(corpus / "pairs.jsonl")], tokenizer, max_documents=5, regenerate=again.answer)
    assert again.generated == 0 and torch.equal(torch.from_numpy(same.tokens), torch.from_numpy(docs.tokens))
    messages = [{"role": "user", "content": "Repeat: red"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(ids, add_special_tokens=False)["input_ids"]])
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                            pad_token_id=tokenizer.eos_token_id)
    assert again.answer(messages) == tokenizer.decode(greedy[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.real_model
@pytest.mark.skipif(not SHIPPED_HEADS, reason="no shipped head")
def test_the_shipped_head_drafts_losslessly_for_the_default_model():
    from graft_cli.method import builder as methods
    from graft_cli.runtime.loading import encode, load_model
    from graft_cli.method.builder import MethodConfig
    from graft_cli.drafting.proposer import GraftProposer
    from graft_cli.core import Stats
    from tests.test_eagle3 import run

    loaded = load_model("smollm2-135m-instruct", "cpu")
    name = SHIPPED_HEADS[0].parent.name
    proposer = methods.build(MethodConfig("dense", 8, draft=f"eagle3:{name}"), loaded)
    prompt = encode(loaded.tokenizer, "List three uses of a paperclip.")
    stats = Stats()
    assert run(loaded.model, proposer, prompt, 24, stats) == run(loaded.model, GraftProposer(0), prompt, 24)
    assert stats.accepted.get("draft", 0) > 0  # a trained head gets drafts accepted (random weights: none)
