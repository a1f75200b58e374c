"""graft's own forward loads without transformers: its config read plainly gives the fields transformers' gives,
and ``graft generate`` on it imports neither transformers nor the modules other commands need."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from graft_cli.catalog.resolve import resolve_model
from graft_cli.models.config import PlainConfig, plain_config, plain_generation
from graft_cli.models.families import family
from graft_cli.runtime.limits import limits

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
UNNEEDED = ("transformers", "accelerate", "torch._dynamo", "torch._inductor", "sympy", "rich", "pyarrow", "faiss",
            "xgrammar", "fastapi", "uvicorn", "safetensors")
PROBE = """
import json, sys
from graft_cli.cli import main
try:
    main(["generate", "Hi", "-n", "1", "--threads", "1", "--device", "cpu"])  # --forward auto: the own forward
except SystemExit as e:
    assert not e.code, e.code
unneeded = {unneeded!r}
print(json.dumps(sorted(m for m in sys.modules if any(m == u or m.startswith(u + ".") for u in unneeded))))
"""


@pytest.mark.real_model
@pytest.mark.parametrize("name", MODELS)
def test_the_plain_config_gives_transformers_fields(name):
    path = Path(resolve_model(name))
    plain, theirs = plain_config(path), AutoConfig.from_pretrained(path, local_files_only=True)
    assert plain is not None
    for field in dataclasses.fields(PlainConfig):
        if field.name not in ("_attn_implementation", "rope_parameters", "layer_types", "use_sliding_window",
                              "sliding_window", "attention_bias", "mlp_bias", "head_dim"):
            assert getattr(plain, field.name) == getattr(theirs, field.name), field.name
    assert plain.rope_parameters == theirs.rope_parameters
    assert (plain.head_dim or plain.hidden_size // plain.num_attention_heads) == \
        (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    assert family(plain) is family(theirs) is not None and limits(plain) == limits(theirs)
    served = family(plain)
    for flag in (served.qkv_bias, served.out_bias, served.mlp_bias):
        assert flag(plain) == flag(theirs)
    generation = json.loads((path / "generation_config.json").read_text())
    assert plain_generation(path).eos_token_id == generation["eos_token_id"]


def test_a_config_the_own_forward_does_not_serve_plainly_is_left_to_transformers(tmp_path):
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
    for changes, served in (({}, True), ({"model_type": "mistral"}, False), ({"quantization_config": {}}, False),
                            ({"rope_scaling": {"type": "linear", "factor": 2.0}}, False),
                            ({"use_sliding_window": True}, False), ({"vocab_size": None}, False)):
        (tmp_path / "config.json").write_text(json.dumps({**base, **changes}))
        assert (plain_config(tmp_path) is not None) == served, changes
    assert plain_config(tmp_path / "missing") is None


@pytest.mark.real_model
def test_generate_on_the_own_forward_imports_no_transformers():
    out = subprocess.run([sys.executable, "-c", PROBE.format(unneeded=UNNEEDED)], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out.splitlines()[-1]) == []
