"""What the host-time instrument decodes with from the command line: a suffix-array store over real text, built
once, and an EAGLE-3 head with random weights (see the package's docstring)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from graft_cli.catalog.home import graft_home
from graft_cli.catalog.resolve import resolve_model

CORPUS = "corpus/alpaca_eval_outputs/gpt4.jsonl"  # under the shared data, beside the benchmark prompts


def datastore(name: str, corpus: Path) -> str:
    """A small suffix-array store over real text, built once under GRAFT_HOME (seconds)."""
    from datastores import DatastoreError
    from datastores.build import build_store
    from datastores.store import read_store

    path = graft_home() / "datastores" / name
    try:
        read_store(path)
    except DatastoreError:
        print(f"building suffix-array store {path} from {corpus} ...", file=sys.stderr)
        build_store([corpus], path, model_dir=resolve_model("smollm2-135m-instruct"),
                    model_name="smollm2-135m-instruct", fields=["output"], jobs=1, force=True)
    return str(path)


def random_head(root: Path, target: torch.nn.Module, draft_vocab: int, sharpness: float) -> str:
    """An EAGLE-3 head with random weights in the format users' heads come in (for the target's width)."""
    from safetensors.torch import save_file

    from graft_cli.heads import HeadConfig, expected_shapes

    c = target.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = c.hidden_size // heads
    config = dict(hidden_size=c.hidden_size, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                  intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, draft_vocab_size=draft_vocab,
                  rms_norm_eps=1e-5, hidden_act="silu")
    (root / "config.json").write_text(json.dumps(config))
    cfg = HeadConfig(c.hidden_size, heads, kv, head_dim, c.intermediate_size, c.vocab_size, draft_vocab, 1e4, 1e-5,
                     "silu")
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in expected_shapes(cfg, c.hidden_size).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            scale = sharpness if name == "lm_head.weight" else 1.0
            tensors[name] = torch.randn(shape, generator=gen) * (scale / shape[-1] ** 0.5)
    tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    save_file(tensors, str(root / "model.safetensors"))
    return f"eagle3:{root}"
