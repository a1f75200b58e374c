"""EAGLE-3 heads in the layouts their publishers ship, written here with random weights under the real config keys
and tensor names: the EAGLE authors' (pytorch_model.bin), SpecForge's (and its EAGLE-3.1 fc_norm / norm_output),
and vLLM's speculators format (llama or qwen3 layer, llama3 RoPE scaling, norm_before_residual, norm_before_fc,
norm_output, configured layers). Each one drafts losslessly; each one's draft logits equal those of transformers'
own decoder layer wired as the publisher's code wires it; a head made for another target is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from graft_cli.core import GraftError, Stats
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.heads import HeadConfig, expected_shapes, load_head
from graft_cli.runtime.engine import decode
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from plugins.adjacency import AdjacencyRetriever
from plugins.eagle3 import Eagle3Drafter
from plugins.prompt_lookup import PromptLookup
from tests.test_eagle3 import target_model
from tests.tiny import VOCAB

DRAFT = 40
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def layer_config(model_type="llama", hidden=64, **extra) -> dict:
    """One decoder layer's config as transformers writes it (head_dim 16, not hidden / heads where hidden is 48)."""
    return {"model_type": model_type, "hidden_size": hidden, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "max_position_embeddings": 2048, "vocab_size": VOCAB, "num_hidden_layers": 1, "tie_word_embeddings": False,
            **extra}


def eagle_authors() -> tuple[dict, dict]:
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config keys: a LlamaConfig of transformers 4.28, no head_dim, no RoPE
    settings, fp16 pytorch_model.bin, no embed_tokens (the target's are used)."""
    config = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 2048,
              "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 2,
              "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
              "transformers_version": "4.28.1", "use_cache": True, "vocab_size": VOCAB, "draft_vocab_size": DRAFT}
    return config, {"fmt": "bin", "dtype": torch.float16}


def specforge(**extra) -> tuple[dict, dict]:
    """SpecForge's LlamaForCausalLMEagle3 export: its own width and head_dim, the target's width, configured layer
    outputs under eagle_config; ``extra``: EAGLE-3.1's fc_norm and norm_output."""
    config = {"architectures": ["LlamaForCausalLMEagle3"], **layer_config(hidden=48, rope_theta=1e6),
              "draft_vocab_size": DRAFT, "target_hidden_size": 64,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3], "use_aux_hidden_state": True}, **extra}
    return config, {"embed": True, "dtype": torch.bfloat16}


def speculators(model_type="llama", layer_extra=None, **extra) -> tuple[dict, dict]:
    """vLLM's speculators config (RedHatAI/*speculator.eagle3): the layer nested, its options at top level."""
    layer = layer_config(model_type, **(layer_extra or {}))
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}},
              "transformer_layer_config": layer, "draft_vocab_size": DRAFT, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "norm_before_residual": True, "norm_before_fc": False,
              "fc_norm": False, "norm_output": False, "embed_requires_grad": False, **extra}
    return config, {"prefix": "layers.0.", "embed": True}


LAYOUTS = {
    "eagle-authors": eagle_authors(),
    "specforge": specforge(),
    "specforge-eagle3.1": specforge(fc_norm=True, norm_output=False),
    "speculators-llama3-rope": speculators(layer_extra={"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}),
    "speculators-qwen3": speculators("qwen3", {"attention_bias": True, "rope_theta": 1e6}, norm_before_residual=False,
                                     norm_before_fc=True, norm_output=True, eagle_aux_hidden_state_layer_ids=[0, 2, 4]),
    "speculators-fc-norm-two-layers": speculators(fc_norm=True, eagle_aux_hidden_state_layer_ids=[1, 3]),
}
LAYERS = {"eagle-authors": (2, 2, 2), "specforge": (1, 3, 4), "specforge-eagle3.1": (1, 3, 4),
          "speculators-llama3-rope": (1, 2, 3), "speculators-qwen3": (0, 2, 4), "speculators-fc-norm-two-layers": (1, 3)}


def write_layout(root: Path, name: str, target, seed: int = 0) -> Path:
    """LAYOUTS[name] with random weights: every tensor its config implies, under the layout's names."""
    config, how = LAYOUTS[name]
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    cfg = load_config(root, target)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, shape in expected_shapes(cfg, target.config.hidden_size).items():
        noise = torch.randn(shape, generator=gen)
        value = 1 + 0.1 * noise if "norm" in key else noise * (0.1 if key.endswith("bias") else 1.5 / shape[-1] ** 0.5)
        tensors[key.replace("midlayer.", how.get("prefix", "midlayer."))] = value.to(how.get("dtype", torch.float32))
    tensors["d2t"] = torch.arange(DRAFT) + 1  # draft id d is target id 2d + 1
    tensors["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, torch.arange(DRAFT) * 2 + 1, True)
    if how.get("embed"):
        tensors["embed_tokens.weight"] = torch.randn((VOCAB, cfg.hidden), generator=gen)
    if how.get("fmt") == "bin":
        torch.save(tensors, str(root / "pytorch_model.bin"))
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(root / "model.safetensors"))
    return root


def load_config(root: Path, target) -> HeadConfig:
    from graft_cli.heads.layouts import head_config, read_config

    return head_config(read_config(root, "test"), target, None, "test")


def run(model, proposer, prompt, n, stats=None):
    return [t for s in decode(Target(model), proposer, prompt, Sampling(), n, set(), 0, stats) for t in s]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_drafts_losslessly(tmp_path, name, kind):
    target = target_model(kind, seed=3)
    head = load_head(str(write_layout(tmp_path / "h", name, target, seed=1)), target)
    drafter = Eagle3Drafter(head, target, depth=4, top_k=3)
    assert drafter.layers == LAYERS[name]
    proposer = GraftProposer(10, [PromptLookup(), AdjacencyRetriever(VOCAB)], drafter=drafter)
    for seed in range(2):
        prompt = np.random.default_rng(seed).integers(0, VOCAB, 9).tolist()
        stats = Stats()
        assert run(target, proposer, prompt, 40, stats) == run(target, GraftProposer(0), prompt, 40)
        assert stats.draft_forwards > 0
    drafted = [n.token for n in drafter.pool.nodes]
    assert drafted and all(t % 2 == 1 and t < 2 * DRAFT for t in drafted)  # through d2t


def reference_logp(root: Path, target, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The draft log-probabilities and fed-back state of one causal pass, computed by transformers' own decoder
    layer (attention, RoPE with its scaling, qwen3's q/k norms, biases) wired as speculators' Eagle3FirstLayerMixin
    and SpecForge's LlamaForCausalLMEagle3 wire theirs."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, Qwen3Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    raw = json.loads((root / "config.json").read_text())
    spec = "speculators_model_type" in raw
    layer_raw = raw["transformer_layer_config"] if spec else raw
    qwen3 = layer_raw.get("model_type") == "qwen3"
    config = (Qwen3Config if qwen3 else LlamaConfig)(**layer_raw, attn_implementation="eager")
    files = list(root.glob("*.safetensors"))
    w = load_file(str(files[0])) if files else torch.load(str(root / "pytorch_model.bin"), weights_only=True)
    w = {k.replace("layers.0.", "midlayer."): v.float() for k, v in w.items()}
    layer = (Qwen3DecoderLayer if qwen3 else LlamaDecoderLayer)(config, 0)
    for p, width in (("q", config.num_attention_heads), ("k", config.num_key_value_heads), ("v", config.num_key_value_heads)):
        setattr(layer.self_attn, f"{p}_proj", torch.nn.Linear(2 * config.hidden_size, width * config.head_dim,
                                                             bias=config.attention_bias))
    layer.load_state_dict({k[len("midlayer."):]: v for k, v in w.items()
                           if k.startswith("midlayer.") and "hidden_norm" not in k}, strict=True)

    def rms(x, name):
        norm = LlamaRMSNorm(x.shape[-1], eps=config.rms_norm_eps)
        norm.weight.data = w[name]
        return norm(x)

    x = rms(features, "input_norm.weight") if raw.get("norm_before_fc") else features
    if raw.get("fc_norm"):
        n = features.shape[-1] // target.config.hidden_size
        x = torch.cat([rms(c, f"fc_norm.{i}.weight") for i, c in enumerate(x.chunk(n, dim=-1))], -1)
    h = x @ w["fc.weight"].T
    emb = w.get("embed_tokens.weight", target.get_input_embeddings().weight)[tokens]
    normed = rms(h, "midlayer.hidden_norm.weight")
    residual = normed if spec and raw.get("norm_before_residual", True) else h
    t = tokens.shape[0]
    cos, sin = LlamaRotaryEmbedding(config)(h[None], torch.arange(t)[None])
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        attn, _ = layer.self_attn(hidden_states=torch.cat([layer.input_layernorm(emb), normed], -1)[None],
                                  position_embeddings=(cos, sin), attention_mask=mask)
        out = residual + attn[0]
        out = out + layer.mlp(layer.post_attention_layernorm(out))
        final = rms(out, "norm.weight")
        logits = (out if raw.get("norm_output") is False and not spec else final) @ w["lm_head.weight"].T
    return torch.log_softmax(logits, -1), (final if spec and raw.get("norm_output") else out)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_computes_what_its_publishers_code_computes(tmp_path, name):
    target = target_model(seed=5)
    root = write_layout(tmp_path / "h", name, target, seed=2)
    head = load_head(str(root), target)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(6, len(LAYERS[name]) * 64, generator=gen)
    tokens = torch.randint(0, VOCAB, (6,), generator=gen)
    out = head.forward(tokens, head.fuse(features), torch.arange(6), torch.ones(6, 6, dtype=torch.bool).tril())
    want_logp, want_state = reference_logp(root, target, features, tokens)
    torch.testing.assert_close(head.logp(out), want_logp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, want_state, atol=1e-4, rtol=1e-4)


MISMATCHES = [
    ("speculators-llama3-rope", {"target_hidden_size": 4096}, None,
     "made for a target of hidden size 4096, but this target's hidden size is 64"),
    ("eagle-authors", {}, {"fc.weight": (64, 96)}, "made for a target of hidden size 32, but this target's"),
    ("eagle-authors", {"vocab_size": 128256}, None,
     f"made for a vocabulary of 128256 tokens (vocab_size), but this target's has {VOCAB}"),
    ("specforge", {}, {"t2d": (151936,)}, f"made for a vocabulary of 151936 tokens (t2d), but this target's has {VOCAB}"),
    ("speculators-qwen3", {"transformer_layer_config": layer_config("qwen3", num_hidden_layers=2)}, None,
     "a head of 2 decoder layers"),
    ("speculators-llama3-rope", {}, {"layers.1.mlp.up_proj.weight": (96, 64)}, "a head of 2 decoder layers"),
    ("speculators-llama3-rope", {"speculators_model_type": "mtp"}, None, "a speculators 'mtp' model"),
    ("speculators-qwen3", {}, {"layers.0.self_attn.q_norm.weight": None}, "missing tensor 'midlayer.self_attn.q_norm"),
]


@pytest.mark.parametrize("name, config, tensors, message", MISMATCHES, ids=[m[3][:40] for m in MISMATCHES])
def test_a_head_for_another_target_is_one_line_naming_the_number(tmp_path, name, config, tensors, message):
    target = target_model()
    root = write_layout(tmp_path / "h", name, target)
    raw = json.loads((root / "config.json").read_text()) | config
    (root / "config.json").write_text(json.dumps(raw))
    if tensors:
        file = next(root.glob("*.safetensors"), root / "pytorch_model.bin")
        from safetensors.torch import load_file, save_file

        state = load_file(str(file)) if file.suffix == ".safetensors" else torch.load(str(file), weights_only=True)
        for key, shape in tensors.items():
            state.pop(key, None) if shape is None else state.__setitem__(key, torch.zeros(shape))
        save_file(state, str(file)) if file.suffix == ".safetensors" else torch.save(state, str(file))
    with pytest.raises(GraftError) as e:
        load_head(str(root), target)
    assert message in str(e.value) and "\n" not in str(e.value) and str(root) in str(e.value)


def test_a_head_by_hub_id_from_the_cache(tmp_path, monkeypatch):
    """``--draft eagle3:ORG/NAME`` reads the head from the hub cache; a missing one is one line."""
    from tests.hub_fixtures import add_snapshot, use_cache

    target = target_model()
    source = write_layout(tmp_path / "src", "eagle-authors", target)
    add_snapshot(tmp_path / "hub", "yuhuili/EAGLE3-Tiny", source, "e" * 40)
    use_cache(monkeypatch, tmp_path / "hub")
    head = load_head("yuhuili/EAGLE3-Tiny", target)
    assert torch.equal(head.w["fc.weight"], load_head(str(source), target).w["fc.weight"])
    with pytest.raises(GraftError, match=r"eagle3 head yuhuili/absent is not in the Hugging Face cache"):
        load_head("yuhuili/absent", target)
