"""EAGLE-3 heads trained by graft (graft_cli/heads/): the training-time test is the drafter's own computation, the
files load in graft and in SpecForge's reference class, and the training data is packed right (training itself,
resuming, the command line and the shipped heads: test_heads_training.py)."""

from __future__ import annotations

import json

import pytest
import torch

from graft_cli.heads import load_head
from graft_cli.heads import checkpoint as ckpt
from graft_cli.heads.data import Batch
from graft_cli.heads.model import context_mask, step_inputs
from graft_cli.heads.teacher import teach
from graft_cli.heads.train import draft_config, new_head
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
    from plugins.eagle3 import Eagle3Drafter
    from graft_cli.core import GraftError

    target = target_model()
    head = tiny_head(target)
    ckpt.write_head(head, target.config, tmp_path / "h", torch.float32, {})
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 3]
    (tmp_path / "h" / "config.json").write_text(json.dumps(raw))
    assert Eagle3Drafter(load_head(str(tmp_path / "h"), target), target).layers == (1, 2, 4)
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 9]
    (tmp_path / "h" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(GraftError, match="eagle_aux_hidden_state_layer_ids must be layer ids in 0..4"):
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
    # 9 rows against 5 and 4: the matmuls block differently, so fp32 sums round differently (seen: 1.8e-5)
    torch.testing.assert_close(whole.features[0], torch.cat([x.features[0] for x in alone]), atol=1e-4, rtol=1e-4)
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
