"""EAGLE-3 heads trained by graft (graft_cli/heads/): the training-time test is the drafter's own computation,
the loss falls, checkpoints resume bit-exactly (also after a real SIGKILL), the files load in graft and in
SpecForge's reference class, and the shipped head matches its README."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graft_cli.drafters.eagle3 import load_head
from graft_cli.heads import checkpoint as ckpt
from graft_cli.heads.data import Batch
from graft_cli.heads.model import context_mask, step_inputs
from graft_cli.heads.teacher import teach
from graft_cli.heads.train import draft_config, new_head
from tests.test_bench import run_cli
from tests.test_eagle3 import target_model
from tests.tiny import VOCAB


def tiny_head(target, draft_vocab=40, seed=1, noise=0.05):
    ids = torch.arange(draft_vocab) * 2 + 1  # a real reduced vocabulary: odd target ids
    head = new_head(target, draft_config(target.config, draft_vocab), ids, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return head


def one_document(tokens):
    t = torch.tensor([tokens])
    return Batch(t, torch.arange(len(tokens))[None], torch.zeros_like(t))


def test_ttt_steps_are_the_drafters_chain(tmp_path):
    """Step k of the unrolled training at row t equals the loaded head drafting depth k from position t."""
    target = target_model()
    head = tiny_head(target)
    tokens = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    batch = one_document(tokens)
    lesson = teach(target, batch, head.cfg.layers, head.draft_ids())
    context = context_mask(batch.docs, torch.float32)
    with torch.no_grad():
        logits = head.unroll(lesson.features, [step_inputs(batch.tokens, batch.positions, k, context) for k in range(3)])
    ckpt.write_head(head, target.config, tmp_path / "h", torch.float32, {})
    infer = load_head(str(tmp_path / "h"), target)
    t = 5
    infer.reset()
    fused = infer.fuse(lesson.features[0, : t + 1])
    rows = torch.arange(t + 1)
    out = infer.forward(torch.tensor(tokens[1 : t + 2]), fused, rows, torch.ones(t + 1, t + 1, dtype=torch.bool).tril())
    state = out[t : t + 1]
    torch.testing.assert_close(infer.logp(state)[0], torch.log_softmax(logits[0][0, t], -1), atol=1e-5, rtol=1e-5)
    for k in (1, 2):
        allowed = torch.ones(1, infer.length + 1, dtype=torch.bool)
        state = infer.forward(torch.tensor([tokens[t + 1 + k]]), state, torch.tensor([t + k]), allowed)
        torch.testing.assert_close(infer.logp(state)[0], torch.log_softmax(logits[k][0, t], -1), atol=1e-5, rtol=1e-5)


# --- the reference: SpecForge's LlamaForCausalLMEagle3 -------------------------------------------------------


def specforge_class():
    pytest.importorskip("specforge.modeling.draft.llama3_eagle", reason="specforge (a dev extra) is not installed")
    torch._dynamo.config.disable = True  # its rotary helper is torch.compile'd; eager is the reference
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    return LlamaForCausalLMEagle3


def specforge_unroll(ref, features, tokens, steps):
    """SpecForge's own TTT loop (OnlineEagle3Model.forward, sdpa backend) over one document: draft logits per step."""
    from specforge.modeling.draft.llama3_eagle import prepare_decoder_attention_mask
    from specforge.utils import padding

    n = tokens.shape[1]
    hidden = ref.project_hidden_states(features)
    mask = prepare_decoder_attention_mask(torch.ones(1, n, dtype=torch.bool), (1, n), hidden, 0)
    positions = torch.arange(n)[None]
    ids = padding(tokens, left=False)
    cache = [[], []]
    out = []
    for _ in range(steps):
        hidden = ref.backbone(ref.embed_input_ids(ids), hidden, cache, mask, positions)
        out.append(ref.compute_logits(hidden))
        ids = padding(ids, left=False)
    return out


def graft_unroll(head, features, tokens, steps):
    batch = one_document(tokens[0].tolist())
    context = context_mask(batch.docs, torch.float32)
    return head.unroll(features, [step_inputs(batch.tokens, batch.positions, k, context) for k in range(steps)])


LLAMA3_ROPE = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROPES = {"default": {"rope_theta": 10000.0, "rope_type": "default"}, "llama3": LLAMA3_ROPE}


def reference_config(target, draft_vocab=40, rope=None):
    from transformers import LlamaConfig

    t = target.config
    config = LlamaConfig(hidden_size=t.hidden_size, num_attention_heads=t.num_attention_heads,
                         num_key_value_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads,
                         intermediate_size=96, vocab_size=t.vocab_size, num_hidden_layers=1,
                         max_position_embeddings=512, rope_parameters=rope or ROPES["default"],
                         architectures=["LlamaForCausalLMEagle3"], tie_word_embeddings=False)
    config.draft_vocab_size = draft_vocab
    return config


def features_and_tokens(target, layers, n=12, seed=3):
    tokens = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hidden = target(tokens, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i] for i in layers], dim=-1), tokens


@pytest.mark.parametrize("rope", list(ROPES))
def test_a_specforge_head_loads_in_graft_with_the_same_logits(tmp_path, rope):
    """Also with Llama-3.1's scaled RoPE; and the same head with the older top-level rope_theta/rope_scaling."""
    Ref = specforge_class()
    target = target_model()
    torch.manual_seed(0)
    ref = Ref(reference_config(target, rope=ROPES[rope])).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape))
        ref.d2t.copy_(torch.arange(40) + 1)  # draft id d -> target id 2d + 1
    ref.save_pretrained(tmp_path / "ref")
    head = load_head(str(tmp_path / "ref"), target)
    features, tokens = features_and_tokens(target, (2, 2, 2))  # layers: head_layers of a 5-layer target
    with torch.no_grad():
        expected = specforge_unroll(ref, features, tokens, 1)[0][0]
    n = tokens.shape[1]
    out = head.forward(tokens[0, 1:], head.fuse(features[0, : n - 1]), torch.arange(n - 1),
                       torch.ones(n - 1, n - 1, dtype=torch.bool).tril())
    torch.testing.assert_close(head.logp(out), torch.log_softmax(expected[: n - 1], -1), atol=1e-5, rtol=1e-5)
    assert head.to_target(torch.tensor([0, 5])).tolist() == [1, 11]
    raw = json.loads((tmp_path / "ref" / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params if rope != "default" else None
    (tmp_path / "ref" / "config.json").write_text(json.dumps(raw))
    old_style = load_head(str(tmp_path / "ref"), target)
    assert old_style.cfg.rope_theta == head.cfg.rope_theta and torch.equal(old_style.inv_freq, head.inv_freq)


def test_aux_layer_ids_choose_the_fused_layers(tmp_path):
    from graft_cli.drafters.eagle3 import Eagle3Drafter
    from graft_cli.errors import GraftError

    target = target_model()
    head = tiny_head(target)
    ckpt.write_head(head, target.config, tmp_path / "h", torch.float32, {})
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 3]
    (tmp_path / "h" / "config.json").write_text(json.dumps(raw))
    assert Eagle3Drafter(load_head(str(tmp_path / "h"), target), target).layers == (1, 2, 4)
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 9]
    (tmp_path / "h" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(GraftError, match="eagle_aux_hidden_state_layer_ids must be 3 layer ids"):
        load_head(str(tmp_path / "h"), target)


def test_a_graft_head_loads_strictly_into_specforge_with_the_same_ttt(tmp_path):
    """The reverse; the file has no embed_tokens (graft uses the target's), so the strict load fills it from the
    target. The whole TTT unroll matches SpecForge's own loop step by step."""
    Ref = specforge_class()
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    target = target_model()
    head = tiny_head(target)
    ckpt.write_head(head, target.config, tmp_path / "h", torch.float32, {})
    config = LlamaConfig.from_dict(json.loads((tmp_path / "h" / "config.json").read_text()))
    ref = Ref(config).eval()
    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert "embed_tokens.weight" not in state
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
    ref.load_state_dict(state, strict=True)
    features, tokens = features_and_tokens(target, head.cfg.layers)
    with torch.no_grad():
        expected = specforge_unroll(ref, features, tokens, 4)
        got = graft_unroll(head, features, tokens, 4)
    n = tokens.shape[1]
    for k in range(4):  # rows whose step-k input token exists (SpecForge pads the rest with token 0)
        torch.testing.assert_close(got[k][0, : n - 1 - k], expected[k][0, : n - 1 - k], atol=1e-5, rtol=1e-5)


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

    from graft_cli.graft import GraftProposer
    from graft_cli.drafters.eagle3 import Eagle3Drafter
    from graft_cli.prune import PruneSchedule
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

    from graft_cli import engine
    from graft_cli.drafters.eagle3 import Eagle3Drafter
    from graft_cli.graft import GraftProposer
    from graft_cli.heads.train import ttt_loss
    from graft_cli.target import Target
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


# --- data ---------------------------------------------------------------------------------------------------------


def test_records_become_chat_messages():
    from graft_cli.heads.data import chat_messages

    assert chat_messages({"instruction": "Add", "input": "1 and 2", "response": "3"}) == [
        {"role": "user", "content": "Add\n\n1 and 2"}, {"role": "assistant", "content": "3"}]
    assert chat_messages({"question": "Q?", "answer": "A."})[1] == {"role": "assistant", "content": "A."}
    assert chat_messages({"instruction": "I", "output": "O", "generator": "x"})[0]["content"] == "I"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert chat_messages({"messages": msgs}) == msgs
    assert chat_messages({"text": "plain"}) is None and chat_messages({"instruction": "no answer"}) is None


def test_packed_documents_do_not_see_each_other():
    """Two documents packed in one sequence give the features and target tokens each gives alone."""
    target = target_model()
    a, b = [5, 6, 7, 8, 9], [11, 12, 13, 14]
    packed = Batch(torch.tensor([a + b]), torch.tensor([list(range(5)) + list(range(4))]),
                   torch.tensor([[0] * 5 + [1] * 4]))
    ids = torch.arange(VOCAB)
    whole = teach(target, packed, (2, 2, 2), ids)
    alone = [teach(target, one_document(d), (2, 2, 2), ids) for d in (a, b)]
    torch.testing.assert_close(whole.features[0], torch.cat([x.features[0] for x in alone]), atol=1e-5, rtol=1e-5)
    assert whole.argmax[0].tolist() == alone[0].argmax[0].tolist() + alone[1].argmax[0].tolist()


def test_batches_are_a_function_of_seed_and_step():
    import numpy as np

    from graft_cli.heads.data import Documents, Packer, draft_vocabulary, split

    lengths = [7, 3, 12, 5, 9, 4, 8, 6, 10, 2]
    tokens = np.concatenate([np.full(n, i, dtype=np.int64) for i, n in enumerate(lengths)])
    docs = Documents(tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    train_docs, held = split(docs, 5)
    assert len(held) == 2 and len(train_docs) == 8
    p, q = Packer(train_docs, 8, 2, seed=1), Packer(train_docs, 8, 2, seed=1)
    for step in (0, 1, 2, 3, 2, 0):
        x, y = p.batch(step), q.batch(step)
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.docs, y.docs)
    first = p.batch(0)
    # inside a sequence, a document's positions count from 0 and its id stays
    for row in range(2):
        for t in range(1, 8):
            same = first.docs[row, t] == first.docs[row, t - 1]
            assert int(first.positions[row, t]) == (int(first.positions[row, t - 1]) + 1 if same else 0)
            assert same == (first.tokens[row, t] == first.tokens[row, t - 1])
    assert not torch.equal(p.batch(0).tokens, p.batch(p.batches_per_epoch).tokens)  # a new epoch, a new order
    ids, coverage = draft_vocabulary(train_docs, 10, 3)
    assert ids.tolist() == [4, 6, 8] and coverage == 27 / 48  # the longest training documents (2 and 7 are held out)


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
    assert code == 2 and "not a directory nor a named head" in err


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
    from graft_cli import methods
    from graft_cli.loading import encode, load_model
    from graft_cli.methods import MethodConfig
    from graft_cli.graft import GraftProposer
    from graft_cli.stats import Stats
    from tests.test_eagle3 import run

    loaded = load_model("smollm2-135m-instruct", "cpu")
    name = SHIPPED_HEADS[0].parent.name
    proposer = methods.build(MethodConfig("dense", 8, draft=f"eagle3:{name}"), loaded)
    prompt = encode(loaded.tokenizer, "List three uses of a paperclip.")
    stats = Stats()
    assert run(loaded.model, proposer, prompt, 24, stats) == run(loaded.model, GraftProposer(0), prompt, 24)
    assert stats.accepted.get("draft", 0) > 0  # a trained head gets drafts accepted (random weights: none)
