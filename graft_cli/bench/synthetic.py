"""Models, tokenizers, heads and proposers built from nothing (no downloads), for checks that must run anywhere:
the unit tests and ``benchmarks/gpu_check.py`` share them.

A large initializer range makes the tiny models' next-token distributions peaked, so greedy ties (which float
noise between batched and one-token forwards could flip) practically never occur in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from datastores import build_store
from graft_cli.heads import HeadConfig, expected_shapes
from graft_cli.core import Needs, Recorder, ROOT, Tree
from graft_cli.method.config import MethodConfig, configure
from graft_cli.runtime.fixed_shapes import Padded
from graft_cli.runtime.graphs import LIMIT, Graphs

VOCAB = 97


def tiny_config(kind: str = "llama", vocab: int = VOCAB, init: float = 0.3, layers: int = 2, **extra):
    """The config of a tiny Llama or Qwen2 (no stop token unless asked for)."""
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama":
        return LlamaConfig(**common | extra)
    return Qwen2Config(**common | {"use_sliding_window": False} | extra)


def tiny_model(kind: str = "llama", seed: int = 0, vocab: int = VOCAB, init: float = 0.3, layers: int = 2, **extra):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind, vocab, init, layers, **extra), dtype=torch.float32).eval()


def word_tokenizer(vocab: int = VOCAB, eos: int | None = None):
    """A fast word-level tokenizer: ``t<k>`` is id k (so any id sequence round-trips through text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = None
    kwargs = {"eos_token": f"t{eos}"} if eos is not None else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", **kwargs)


def save_model_dir(path: Path, model, tokenizer) -> Path:
    """A model directory ``graft_cli.runtime.loading.load_model`` reads like any downloaded one."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_eagle3_head(root: Path, target, hidden: int = 48, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                      intermediate: int = 96, draft_vocab: int = 40, seed: int = 0) -> Path:
    """A random EAGLE-3 head for ``target`` in the format users' heads come in (config.json + model.safetensors,
    ``d2t`` mapping draft id d to target id 2d + 1)."""
    from safetensors.torch import save_file

    vocab = target.config.vocab_size
    cfg = HeadConfig(hidden, heads, kv_heads, head_dim, intermediate, vocab, draft_vocab, 10000.0, 1e-6, "silu")
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": intermediate, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-6, "hidden_act": "silu"}))
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(cfg, target.config.hidden_size).items():
        noise = torch.randn(shape, generator=gen)
        weights[name] = 1 + 0.1 * noise if name.endswith("norm.weight") else noise * 1.5 / shape[-1] ** 0.5
    weights["d2t"] = torch.arange(draft_vocab) + 1
    weights["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    if target.config.hidden_size != hidden:
        weights["embed_tokens.weight"] = torch.randn((vocab, hidden), generator=gen)
    save_file(weights, str(root / "model.safetensors"))
    return root


def synthetic_models(root: Path, vocab: int = VOCAB, hidden: int = 64, layers: int = 2) -> tuple[Path, Path]:
    """A target saved like a download (a word-level tokenizer) and a random EAGLE-3 head for it, under ``root``."""
    model = tiny_model("llama", seed=0, vocab=vocab, layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                       max_position_embeddings=4096)
    target = save_model_dir(root / "target", model, word_tokenizer(vocab))
    heads = max(1, hidden // 64)
    head = write_eagle3_head(root / "eagle3", model, hidden=hidden, heads=heads, kv_heads=heads,
                             head_dim=hidden // heads, intermediate=2 * hidden, draft_vocab=vocab // 2)
    return target, head


def method_configs(target: Path, head: Path, store: Path | None, depth: int | None) -> dict[str, MethodConfig]:
    """Every engine method a user runs, as the CLI would configure it, the target drafting for itself (rest
    only once its datastore exists)."""
    draft = str(target)
    configs = {
        "ar": configure("ar"),
        "pld": configure("pld"),
        "recycling": configure("recycling"),
        "dense": configure("dense", draft=draft, depth=depth),
        "pruned": configure("pruned", draft=draft, depth=depth),
        "graft": configure("graft", draft=draft, depth=depth),
        "graft-tail": configure("graft", draft=draft, chain=True, depth=depth),
        "eagle3": configure("dense", draft=f"eagle3:{head}", depth=depth),
    }
    if store is not None:
        configs["rest"] = configure("rest", datastore=str(store))
    return configs


def text_store(root: Path, target: Path, texts: list[str]) -> Path:
    """A suffix-array datastore over ``texts`` for the model directory ``target`` (what REST retrieves from)."""
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    build_store([corpus], root / "store", model_dir=target)
    return root / "store"


def random_tree(size: int, vocab: int, rng: np.random.Generator) -> Tree:
    """A tree of ``size`` random nodes, a fifth of them children of the root (fewer when tokens merge)."""
    tree = Tree()
    while len(tree) < size:
        parent = ROOT if not len(tree) or rng.random() < 0.2 else int(rng.integers(len(tree)))
        tree.add(parent, int(rng.integers(vocab)), "random", 0.5)
    return tree


class StaticProposer:
    """Base of test proposers whose trees come from ``propose`` alone: they learn nothing from verification."""

    needs = Needs()
    recorder = Recorder()  # test proposers time nothing of their own
    drafter = None

    def start(self, prompt, prefill, capacity) -> None:
        pass

    def observe(self, step) -> None:
        pass

    def price(self, scores) -> int:  # no cost model: every node is verified
        return len(scores)

    def close(self) -> None:
        pass


class OracleTreeProposer(StaticProposer):
    """Random trees that hide the true continuation (known from a plain run) at random places, sometimes
    corrupted, among random siblings: deep, wide and degenerate shapes all occur."""

    def __init__(self, truth: list[int], prompt_len: int, seed: int, shape: str = "mixed", vocab: int = VOCAB) -> None:
        self.truth, self.prompt_len, self.shape, self.vocab = truth, prompt_len, shape, vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, context) -> Tree:
        rng, tree, vocab = self.rng, Tree(), self.vocab
        done = len(context) - self.prompt_len
        future = self.truth[done:]
        shape = self.shape if self.shape != "mixed" else rng.choice(["deep", "wide", "empty", "random"])
        if shape == "empty":
            return tree
        if shape == "wide":
            for _ in range(int(rng.integers(1, 60))):
                tree.add(ROOT, int(rng.integers(vocab)), "w", float(rng.random()))
        if shape in ("random", "wide"):
            for _ in range(int(rng.integers(1, 30))):
                parent = ROOT if not len(tree) or rng.random() < 0.3 else int(rng.integers(len(tree)))
                tree.add(parent, int(rng.integers(vocab)), "r", float(rng.random()))
        path = list(future[: int(rng.integers(0, 40 if shape == "deep" else 8))])
        if path and rng.random() < 0.3:  # a wrong token somewhere along the true path
            path[int(rng.integers(len(path)))] = int(rng.integers(vocab))
        if len(tree) and rng.random() < 0.5:  # hang it under a random node too (usually wrong)
            tree.add_path(path, [0.5] * len(path), "oracle", int(rng.integers(len(tree))))
        tree.add_path(path, [0.5] * len(path), "oracle", ROOT)
        return tree


class ReplayCapture:
    """A CPU stand-in for a CUDA graph's capture, for checks that must run anywhere: the region's outputs at its
    capture are its outputs for good, and each replay runs the region again and copies its fresh outputs into
    them, as a graph's replay overwrites its outputs in place (the capture's own run is the first replay's).
    ``wrong_buffer``: a broken capture whose replays write buffers of their own, so the host reads the outputs
    of the capture's run again -- the stale buffer the first-use check (graft_cli/api/capture_check.py) catches."""

    def __init__(self, wrong_buffer: bool = False) -> None:
        self.wrong_buffer, self.replays = wrong_buffer, 0

    def __call__(self, region):
        out = region()
        pending = [True]

        def replay() -> None:
            if pending:
                pending.pop()
                return
            self.replays += 1
            fresh = region()
            if not self.wrong_buffer:
                copy_outputs(out, fresh)
        return replay, out


def copy_outputs(static, new) -> None:
    """Copy a region's fresh outputs into its static ones (a :class:`Padded`, a tuple of tensors, or a tensor)."""
    if isinstance(static, Padded):
        copy_outputs((static.logits, *(static.hidden or ()), static.features),
                     (new.logits, *(new.hidden or ()), new.features))
    elif isinstance(static, tuple):
        for mine, theirs in zip(static, new):
            if mine is not None:
                mine.copy_(theirs)
    elif static is not None:
        static.copy_(new)

class CountedGraphs(Graphs):
    """:class:`Graphs` that keeps a GPU's books -- each key counted, captured after its warm-ups, trimmed past the
    limit -- and runs every region eagerly: what a CPU can say of the keys the captured path would hold."""

    def __init__(self, limit: int = LIMIT) -> None:
        super().__init__(None, limit=limit)

    def run(self, key, region):
        self.capture = _nothing_recorded
        try:
            super().run(key, _nothing)
        finally:
            self.capture = None  # a drafter that follows the target's capture runs eagerly
        return region()


def _nothing() -> None:
    return None


def _nothing_recorded(region) -> tuple:
    return _nothing, region()
