"""``--regenerate``: train on the target's own answers. The response of every instruction/response record is
replaced by the target's greedy answer to its prompt, so the head learns the text it will really draft for.

Answers are cached in the run directory (``regenerated.jsonl``, one ``{"key", "answer"}`` line per prompt,
appended and flushed as they come), so a resumed run reads them back instead of generating again; a line cut
short by a killed run is ignored and regenerated.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch


class Regenerator:
    """``answer(messages)``: the target's greedy reply to ``messages`` (the conversation before the reply)."""

    def __init__(self, model: Any, tokenizer: Any, cache: Path, max_new_tokens: int) -> None:
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens
        self.cache = Path(cache)
        self.known: dict[str, str] = {}
        if self.cache.exists():
            for line in self.cache.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.known[entry["key"]] = entry["answer"]
                except (ValueError, KeyError, TypeError):
                    continue  # the cut-off last line of a killed run
        self.generated = 0

    def _key(self, messages: list[dict]) -> str:
        blob = json.dumps([messages, self.max_new_tokens], sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    @torch.no_grad()
    def answer(self, messages: list[dict]) -> str:
        key = self._key(messages)
        if key not in self.known:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]],
                               device=next(self.model.parameters()).device)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=self.max_new_tokens, pad_token_id=self.tokenizer.eos_token_id)
            self.known[key] = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            with open(self.cache, "a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "answer": self.known[key]}) + "\n")
            self.generated += 1
        return self.known[key]
