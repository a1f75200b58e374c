"""EAGLE-3 heads with random weights, written in the format users' heads come in: loading, shapes, d2t,
head_dim, the head's KV cache, loader errors, and losslessness through the whole loop."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from graft_cli.core import DraftSettings, GraftError, PruneSchedule, Stats
from graft_cli.method import builder as methods
from graft_cli.heads import expected_shapes, layer_indices, load_head
from plugins.eagle3 import Eagle3Drafter
from graft_cli.runtime.engine import decode
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.loading import Loaded
from graft_cli.method.builder import MethodConfig
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from plugins.adjacency import AdjacencyRetriever
from plugins.prompt_lookup import PromptLookup
from tests.tiny import VOCAB, tiny_model


def target_model(kind="llama", seed=0, layers=5):
    """tests/tiny.py's model, deeper: EAGLE-3 reads layers 2, N//2 and N-3."""
    from transformers import AutoModelForCausalLM

    raw = tiny_model(kind, seed=seed).config.to_dict()
    raw.update(num_hidden_layers=layers)
    raw.pop("layer_types", None)
    config = type(tiny_model(kind).config)(**raw)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def write_head(root: Path, target, hidden=48, heads=4, kv_heads=2, head_dim=16, inter=96, draft_vocab=40,
               embed=False, fmt="safetensors", seed=0, d2t=None, drop=(), reshape=None, config_extra=None):
    """A random head in the EAGLE-3 format; ``drop``/``reshape`` damage it on purpose."""
    root.mkdir(parents=True, exist_ok=True)
    vocab = target.config.vocab_size
    config = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  intermediate_size=inter, vocab_size=vocab, draft_vocab_size=draft_vocab, rms_norm_eps=1e-6,
                  hidden_act="silu", **(config_extra or {}))
    (root / "config.json").write_text(json.dumps(config))
    from graft_cli.heads import HeadConfig

    cfg = HeadConfig(hidden, heads, kv_heads, head_dim, inter, vocab, draft_vocab, 10000.0, 1e-6, "silu")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg, target.config.hidden_size).items():
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * (1.5 / shape[-1] ** 0.5)
    if d2t is None:  # draft id d -> target id 2d + 1: a real reduced vocabulary
        d2t = torch.arange(draft_vocab) + 1
    tensors["d2t"] = d2t
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    if embed or target.config.hidden_size != hidden:
        tensors["embed_tokens.weight"] = torch.randn((vocab, hidden), generator=gen)
    for name in drop:
        tensors.pop(name)
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.zeros(shape)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(root / "model.safetensors"))
    else:
        torch.save(tensors, str(root / "pytorch_model.bin"))
    return root


def run(model, proposer, prompt, n, stats=None):
    return [t for s in decode(Target(model), proposer, prompt, Sampling(), n, set(), 0, stats) for t in s]


def test_loads_with_head_dim_and_maps_the_draft_vocabulary(tmp_path):
    target = target_model()
    head = load_head(str(write_head(tmp_path / "h", target)), target, rope_theta=500000.0)
    assert head.cfg.head_dim == 16 and head.cfg.heads * head.cfg.head_dim != head.cfg.hidden
    assert head.cfg.rope_theta == 500000.0  # the option wins over the config
    assert layer_indices(5) == (2, 2, 2) and layer_indices(32) == (2, 16, 29)
    feats = torch.randn(3, 3 * target.config.hidden_size)
    out = head.forward(torch.tensor([1, 2, 3]), head.fuse(feats), torch.arange(3),
                       torch.ones(3, 3, dtype=torch.bool).tril())
    assert out.shape == (3, 48) and head.length == 3
    assert head.logp(out).shape == (3, 40)
    assert head.to_target(torch.tensor([0, 5, 39])).tolist() == [1, 11, 79]


def test_drafted_tokens_come_through_d2t(tmp_path):
    target = target_model()
    head_dir = write_head(tmp_path / "h", target)
    head = load_head(str(head_dir), target)
    drafter = Eagle3Drafter(head, target, depth=3, top_k=2)
    proposer = GraftProposer(6, drafter=drafter)
    stats = Stats()
    run(target, proposer, [1, 2, 3, 4], 6, stats)
    tree = drafter.pool
    # d2t[d] = d + 1 maps draft id d to target id 2d + 1: every drafted token is odd and below 80
    assert len(tree) > 4 and all(n.token % 2 == 1 and n.token < 80 for n in tree.nodes)
    assert stats.draft_forwards >= 3


def test_reads_the_bin_format_with_weights_only(tmp_path):
    target = target_model()
    a = load_head(str(write_head(tmp_path / "a", target, fmt="safetensors", seed=3)), target)
    b = load_head(str(write_head(tmp_path / "b", target, fmt="bin", seed=3)), target)
    for name in a.w:
        assert torch.equal(a.w[name], b.w[name])


def test_the_head_cache_matches_one_pass(tmp_path):
    target = target_model()
    head = load_head(str(write_head(tmp_path / "h", target, embed=True)), target)
    tokens, feats = torch.tensor([5, 6, 7, 8, 9]), torch.randn(5, 3 * 64)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    whole = head.forward(tokens, head.fuse(feats), torch.arange(5), causal)
    head.reset()
    first = head.forward(tokens[:3], head.fuse(feats[:3]), torch.arange(3), causal[:3, :3])
    rest = head.forward(tokens[3:], head.fuse(feats[3:]), torch.arange(3, 5), causal[3:])
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["dense", "pruned", "graft", "chain"])
def test_any_head_is_lossless_through_the_loop(tmp_path, kind, method):
    target = target_model(kind, seed=2)
    head = load_head(str(write_head(tmp_path / "h", target, seed=1)), target)
    prune = None if method == "dense" else PruneSchedule.parse("0:0.3,1:0.2")
    drafter = Eagle3Drafter(head, target, depth=4, top_k=3, prune=prune, chain=method == "chain")
    retrievers = [PromptLookup(), AdjacencyRetriever(VOCAB)] if method in ("graft", "chain") else []
    proposer = GraftProposer(10, retrievers, drafter=drafter, tail=method == "chain")
    for seed in range(2):
        prompt = np.random.default_rng(seed).integers(0, VOCAB, 9).tolist()
        truth = run(target, GraftProposer(0), prompt, 40)
        stats = Stats()
        assert run(target, proposer, prompt, 40, stats) == truth
        assert stats.draft_forwards > 0


def test_head_state_follows_the_context(tmp_path):
    """After every step the head has read exactly one pair per context token but the newest."""
    target = target_model(seed=4)
    head = load_head(str(write_head(tmp_path / "h", target)), target)
    drafter = Eagle3Drafter(head, target, depth=3, top_k=2)
    proposer = GraftProposer(8, drafter=drafter)
    prompt = [3, 1, 4, 1, 5]
    gen = torch.Generator().manual_seed(0)
    context = list(prompt)
    for new in decode(Target(target), proposer, prompt, Sampling(), 20, set(), 0):
        context.extend(new)
        if len(context) - len(prompt) >= 20:  # the last step may be cut short of what was accepted
            break
        assert drafter.committed + len(drafter.pending_tokens) == len(context) - 1
        assert head.length - drafter.tree_rows == drafter.committed or drafter.tree_rows == 0


def test_build_with_eagle3_spec(tmp_path):
    target = target_model()
    head_dir = write_head(tmp_path / "h", target)
    loaded = Loaded(target, None, Path("."), "tiny")
    p = methods.build(MethodConfig("graft", 8, draft=f"eagle3:{head_dir}", drafting=DraftSettings(rope_theta=1e6)), loaded)
    assert isinstance(p.drafter, Eagle3Drafter) and p.needs.hidden and p.drafter.head.cfg.rope_theta == 1e6
    prompt = [1, 2, 3, 4, 5, 6]
    assert run(target, p, prompt, 20) == run(target, GraftProposer(0), prompt, 20)


LOADER_ERRORS = [
    (dict(drop=["midlayer.self_attn.q_proj.weight"]), "missing tensor 'midlayer.self_attn.q_proj.weight'"),
    (dict(drop=["lm_head.weight"]), "missing tensor 'lm_head.weight'"),
    (dict(reshape={"fc.weight": (48, 64)}), "tensor 'fc.weight' has shape [48, 64], expected [48, 192]"),
    (dict(reshape={"midlayer.self_attn.q_proj.weight": (48, 96)}), "expected [64, 96]"),  # head_dim honoured
    (dict(d2t=torch.arange(40) * 10), "outside the target vocabulary"),
    (dict(d2t=torch.zeros(40)), "'d2t' must be 40 integers"),
    (dict(config_extra={"num_key_value_heads": 3}), "do not split"),
]


@pytest.mark.parametrize("damage,message", LOADER_ERRORS, ids=[m for _, m in LOADER_ERRORS])
def test_loader_errors_are_one_line(tmp_path, damage, message):
    target = target_model()
    cfg = damage.pop("config_extra", None)
    head_dir = write_head(tmp_path / "h", target, config_extra=None, **damage)
    if cfg:
        raw = json.loads((head_dir / "config.json").read_text())
        raw.update(cfg)
        (head_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(GraftError) as e:
        load_head(str(head_dir), target)
    assert message in str(e.value) and "\n" not in str(e.value) and str(head_dir) in str(e.value)


def test_bad_directories_are_one_line(tmp_path):
    target = target_model()
    cases = {}
    cases["not a directory"] = tmp_path / "absent"
    (tmp_path / "noconf").mkdir()
    cases["no config.json"] = tmp_path / "noconf"
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text(json.dumps({"hidden_size": 48, "num_attention_heads": 4,
                                                       "intermediate_size": 96}))
    cases["no weights"] = noweights
    broken = write_head(tmp_path / "broken", target)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    cases["cannot read model.safetensors"] = broken
    badjson = tmp_path / "badjson"
    badjson.mkdir()
    (badjson / "config.json").write_text("{")
    cases["config.json is unreadable"] = badjson
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    (lacking / "config.json").write_text(json.dumps({"hidden_size": 48}))
    cases["config.json lacks num_attention_heads"] = lacking
    for message, path in cases.items():
        with pytest.raises(GraftError) as e:
            load_head(str(path), target)
        assert message in str(e.value) and "\n" not in str(e.value), (message, str(e.value))


def test_a_pickle_with_code_is_refused(tmp_path):
    target = target_model()
    head_dir = write_head(tmp_path / "h", target, fmt="bin")

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    torch.save({"x": Evil()}, str(head_dir / "pytorch_model.bin"))
    with pytest.raises(GraftError, match="cannot read pytorch_model.bin"):
        load_head(str(head_dir), target)


def test_the_head_reads_the_target_features_aligned_with_the_next_token(tmp_path):
    """What the head has read after a run (incrementally, from verification forwards) equals one pass over the
    whole context: features at position t paired with the token at t + 1."""
    target = target_model(seed=6)
    head = load_head(str(write_head(tmp_path / "h", target, seed=2)), target)
    drafter = Eagle3Drafter(head, target, depth=3, top_k=2)
    proposer = GraftProposer(8, [PromptLookup()], drafter=drafter)
    prompt = [9, 8, 7, 6, 9, 8, 7]
    seen = []
    observe = proposer.observe
    proposer.observe = lambda step: (seen.append(list(step.context)), observe(step))
    run(target, proposer, prompt, 25)
    context = seen[-1]  # the engine's context: the last step may hold more than the 25 tokens returned
    drafter._drop_tree([])
    incremental, _ = drafter._root(context)
    with torch.no_grad():
        hidden = target(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states
    feats = torch.cat([hidden[i][0] for i in layer_indices(target.config.num_hidden_layers)], dim=-1)
    head.reset()
    n = len(context) - 1
    out = head.forward(torch.tensor(context[1:]), head.fuse(feats), torch.arange(n),
                       torch.ones(n, n, dtype=torch.bool).tril())
    torch.testing.assert_close(incremental, head.logp(out[-1]), atol=1e-3, rtol=1e-3)
