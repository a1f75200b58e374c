"""A model's tokenizer read straight from its tokenizer.json with the ``tokenizers`` library, and its chat template
rendered with jinja2 (graft_cli/models/chat.py): what graft's own forward loads instead of transformers'
``AutoTokenizer``, which imports transformers' machinery (over a second on a 2-core EPYC) for the same Rust
tokenizer.

The rule that keeps the ids exactly transformers': the light tokenizer serves a model only when transformers would
run the file's own tokenizer, and every setting of tokenizer_config.json is one reproduced here --

* ``tokenizer_class`` is one of ``CLASSES``: transformers' generic backend, which runs tokenizer.json as it is, or
  Qwen2's, which rebuilds the file's vocabulary and merges in its own pipeline (``_qwen2``: Unicode NFC first, the
  model's split pattern, byte-level), reproduced here with the same parts;
* every other key is in ``KNOWN`` with a value that changes nothing (no BOS or EOS added by the config, special
  tokens not split, no clean-up of spaces), and every named special token is already one of the file's tokens;
* the file pads and truncates nothing, and the chat template (chat_template.jinja, else the config's one string)
  compiles in transformers' environment.

Anything else is None and transformers loads the tokenizer. tests/test_light_tokenizer.py checks ids, templates
and decoded text against transformers on the catalog's models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from graft_cli.models.chat import compile_template, render

SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
KNOWN = {  # tokenizer_config.json keys and the values the light tokenizer reproduces (None: any value)
    "backend": ("tokenizers",), "tokenizer_class": None, "model_max_length": None, "is_local": None,
    "local_files_only": None, "chat_template": None, "added_tokens_decoder": None, "model_input_names": None,
    "padding_side": None, "truncation_side": None, "errors": ("replace",), "add_prefix_space": (None, False),
    "clean_up_tokenization_spaces": (False,), "split_special_tokens": (False,), "add_bos_token": (False,),
    "add_eos_token": (False,), **{name: None for name in SPECIALS},
}
ADDED = ("content", "special", "lstrip", "rstrip", "normalized", "single_word")  # an added token's settings
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def _qwen2(backend: Tokenizer) -> Tokenizer | None:
    """Qwen2's pipeline over the file's vocabulary and merges, as transformers' Qwen2 tokenizer builds it."""
    model = backend.model
    plain_bpe = {"dropout": None, "unk_token": None, "continuing_subword_prefix": "", "end_of_word_suffix": "",
                 "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}
    if not isinstance(model, models.BPE) or any((getattr(model, key) or value) != value
                                                 for key, value in plain_bpe.items()):
        return None
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


CLASSES = {"TokenizersBackend": lambda backend: backend, "PreTrainedTokenizerFast": lambda backend: backend,
           "Qwen2Tokenizer": _qwen2}


class LightTokenizer:
    """The calls graft makes of a transformers tokenizer, over the ``tokenizers`` library's own. ``template``: the
    chat template's text and its compiled form (None: the model has none)."""

    def __init__(self, backend: Tokenizer, specials: dict[str, str],
                 template: tuple[str, jinja2.Template] | None) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = specials  # the named special tokens: {"eos_token": "<|im_end|>", ...}
        self.chat_template, self._template = template or (None, None)
        self.all_special_tokens = list(dict.fromkeys(specials.values()))
        self.all_special_ids = [backend.token_to_id(token) for token in self.all_special_tokens]

    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    @property
    def added_tokens_decoder(self) -> dict:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            tools: list[dict] | None = None) -> str | list[int]:
        """transformers' call, for one conversation of dict messages and dict tools (module docstring)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        text = render(self._template, messages, self.special_tokens_map, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def light_tokenizer(directory: Path) -> LightTokenizer | None:
    """``directory``'s tokenizer without transformers, or None where the rule of the module docstring says
    transformers must load it."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception:  # a missing or unreadable file (tokenizers raises plain Exception): transformers says why
        return None
    adapt = CLASSES.get(config.get("tokenizer_class"))
    if adapt is None or backend.padding is not None or backend.truncation is not None:
        return None
    if any(key not in KNOWN or (KNOWN[key] is not None and config[key] not in KNOWN[key]) for key in config):
        return None
    specials = {name: _content(config[name]) for name in SPECIALS if config.get(name) is not None}
    added = backend.get_added_tokens_decoder()
    listed = {int(i): entry for i, entry in (config.get("added_tokens_decoder") or {}).items()}
    if any(backend.token_to_id(token) is None for token in specials.values()) or any(
            i not in added or any(getattr(added[i], key) != entry.get(key, getattr(added[i], key)) for key in ADDED)
            for i, entry in listed.items()):
        return None
    source = _chat_template(directory, config)
    compiled = None if not source else compile_template(source)
    backend = adapt(backend)
    if source is False or (source and compiled is None) or backend is None:
        return None
    return LightTokenizer(backend, specials, (source, compiled) if source else None)


def _content(token: Any) -> str:
    """A special token's text: a string, or transformers' serialised AddedToken (``{"content": ...}``)."""
    return token["content"] if isinstance(token, dict) else str(token)


def _chat_template(directory: Path, config: dict) -> str | None | bool:
    """The chat template transformers would use: chat_template.jinja, else the config's string; False where the
    model names several (transformers picks among them)."""
    path = directory / "chat_template.jinja"
    if (directory / "additional_chat_templates").exists():
        return False
    if path.exists():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if template is None or isinstance(template, str) else False
