"""The tokenizer graft's own forward reads without transformers (graft_cli/models/tokenizer.py) gives transformers'
ids, chat text and decoded text on the catalog's models, and refuses (so transformers loads) what it would not
reproduce."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from graft_cli.catalog.resolve import resolve_model
from graft_cli.models.tokenizer import LightTokenizer, light_tokenizer
from graft_cli.runtime.loading import encode

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
TEXTS = [
    "Hi", " leading space", "trailing space ", "  two  spaces\tand a tab\n\nand blank lines\n", "",
    "naïve café, Ångström, ﬁ ligature, e\u0301 (a combining accent), Ω vs \u2126", "日本語のテキストと中文", "emoji 👩‍💻🚀",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # comment\n", "if (a && b) { x->y = z[i] >> 2; }",
    "<|im_start|>user\nspecial tokens in text<|im_end|>", "<|endoftext|><tool_call>{\"name\": 1}</tool_call>",
    "\r\n windows line\r\nends", "1234567890 3.14159 -0.5", "'s 're 've 'm 'll 'd IT'S", "\u00a0no-break\u200bzero",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Write code."}, {"role": "assistant", "content": "def f(): pass"},
     {"role": "user", "content": "Shorter, with ünïcode 😀"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                                                                              "tool_calls": None}],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city, «now».",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module", params=MODELS)
def pair(request) -> tuple[LightTokenizer, object]:
    path = Path(resolve_model(request.param))
    light = light_tokenizer(path)
    assert light is not None, f"{request.param}: the light tokenizer refused a catalog model"
    return light, AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.mark.real_model
def test_the_tokenizer_is_transformers_own_pipeline_and_special_tokens(pair):
    light, theirs = pair
    assert json.loads(light.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "eos_token", "all_special_ids", "chat_template",
                 "special_tokens_map", "vocab_size"):
        assert getattr(light, name) == getattr(theirs, name), name
    assert light.get_vocab() == theirs.get_vocab() and len(light) == len(theirs)
    assert light.added_tokens_decoder.keys() == theirs.added_tokens_decoder.keys()


@pytest.mark.real_model
def test_encode_and_decode_give_transformers_ids_and_text(pair):
    light, theirs = pair
    for text in TEXTS:
        for special in (True, False):
            ids = light.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert light.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    odd = [light.eos_token_id, 5, 300, light.eos_token_id, 17, 10000, 2]  # specials among ordinary ids
    assert light.decode(odd, skip_special_tokens=True) == theirs.decode(odd, skip_special_tokens=True)


@pytest.mark.real_model
def test_the_chat_template_renders_as_transformers_renders_it(pair):
    light, theirs = pair
    for messages in CONVERSATIONS + [[{"role": "user", "content": text}] for text in TEXTS[:6]]:
        for generation in (True, False):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            assert light.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation) == want
        assert encode(light, messages) == encode(theirs, messages)
    if "tools" in light.chat_template:
        for messages in CONVERSATIONS[:2]:
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=TOOLS)
            assert light.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=TOOLS) == want
            assert encode(light, messages, tools=TOOLS) == encode(theirs, messages, tools=TOOLS)
    assert encode(light, "Hi", raw=True) == encode(theirs, "Hi", raw=True)


def _copy(tmp_path: Path, config: dict | None = None, template: str | None = None) -> Path:
    """The default model's tokenizer files in ``tmp_path``, its tokenizer_config.json updated with ``config``."""
    source = Path(resolve_model(MODELS[0]))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, tmp_path / name)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, **(config or {})}))
    if template is not None:
        (tmp_path / "chat_template.jinja").write_text(template)
    return tmp_path


@pytest.mark.real_model
@pytest.mark.parametrize("config, template", [
    ({"add_bos_token": True}, None),  # transformers would add a BOS the file's post-processor does not
    ({"tokenizer_class": "LlamaTokenizer"}, None),  # a class that rebuilds its own pipeline
    ({"some_new_setting": 1}, None),  # a setting the light tokenizer does not know
    ({"eos_token": "<|not-a-token|>"}, None),  # transformers would add the token
    ({"added_tokens_decoder": {"5": {"content": "<file_sep>", "special": False}}}, None),  # a token's flag changed
    ({}, "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"),  # transformers' own tag
])
def test_what_the_light_tokenizer_would_not_reproduce_loads_through_transformers(tmp_path, config, template):
    assert light_tokenizer(_copy(tmp_path)) is not None
    assert light_tokenizer(_copy(tmp_path, config, template)) is None
