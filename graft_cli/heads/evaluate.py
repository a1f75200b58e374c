"""``graft heads eval``: how far a head's chain drafts agree with the target on real prompts, without the
decoding loop. Each prompt gets the target's own greedy continuation; one target forward over prompt +
continuation gives the features and the target's greedy token at every position; the head's chain from every
generated position is unrolled teacher-forced (the training-time test is the drafter's chain computation,
tests/test_heads.py), and step k counts as accepted when steps 0..k all equal the target's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from graft_cli.heads.head import Eagle3Head
from graft_cli.heads.data import Batch
from graft_cli.heads.model import TrainableHead, context_mask, shift, step_inputs
from graft_cli.heads.teacher import teach


def trainable(head: Eagle3Head, target: torch.nn.Module) -> TrainableHead:
    """A loaded head (plugins.eagle3) as the module the training-time test runs on."""
    cfg = head.cfg
    model = TrainableHead(cfg, target.config.hidden_size, head.embed).to(head.device)
    model.load_state_dict({**head.w, "d2t": head.d2t, "t2d": torch.zeros(cfg.vocab, dtype=torch.bool)},
                          strict=True)
    model.set_vocab(model.draft_ids())
    return model.to(torch.float32).eval()


@dataclass
class ChainCounts:
    """Per draft step k: rows evaluated at k, and rows whose steps 0..k were all right."""

    rows: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, rows: Sequence[int], accepted: Sequence[int]) -> None:
        if not self.rows:
            self.rows, self.accepted = [0] * len(rows), [0] * len(rows)
        self.rows = [a + b for a, b in zip(self.rows, rows)]
        self.accepted = [a + b for a, b in zip(self.accepted, accepted)]

    def report(self) -> dict:
        chain = [a / r if r else 0.0 for a, r in zip(self.accepted, self.rows)]
        step = [c / p if p else 0.0 for c, p in zip(chain, [1.0, *chain[:-1]])]
        # a chain of len(chain) drafts verified in one forward yields 1 + the expected accepted drafts
        return {"positions": self.rows[0] if self.rows else 0, "chain_acceptance": [round(c, 4) for c in chain],
                "step_acceptance": [round(s, 4) for s in step], "tokens_per_forward": round(1 + sum(chain), 3)}


@torch.no_grad()
def chain_counts(model: TrainableHead, target: torch.nn.Module, prompt: list[int], continuation: list[int],
                 steps: int) -> tuple[list[int], list[int]]:
    """Teacher-forced chains from every position after the prompt of ``prompt + continuation``."""
    tokens = torch.tensor([prompt + continuation], device=model.d2t.device)
    n = tokens.shape[1]
    batch = Batch(tokens, torch.arange(n, device=tokens.device)[None], torch.zeros_like(tokens))
    lesson = teach(target, batch, model.cfg.layers, model.draft_ids())
    context = context_mask(batch.docs, torch.float32)
    logits = model.unroll(lesson.features, [step_inputs(tokens, batch.positions, k, context) for k in range(steps)])
    index = torch.arange(n, device=tokens.device)
    base = index >= len(prompt) - 1  # the row of the last prompt token drafts the second generated token
    alive = torch.ones_like(base)
    rows, accepted = [], []
    for k, lk in enumerate(logits):
        inside = base & (index + 1 + k < n)
        alive = alive & (model.draft_ids()[lk[0].argmax(-1)] == shift(lesson.argmax, 1 + k)[0])
        rows.append(int(inside.sum()))
        accepted.append(int((alive & inside).sum()))
    return rows, accepted


def evaluate_head(loaded: Any, head: Eagle3Head, prompts: Sequence[list[int]], max_new_tokens: int,
                  steps: int, on_prompt: Any = None) -> dict:
    """Chain acceptance of ``head`` over ``prompts`` (token ids, chat-templated) for the loaded target."""
    model = trainable(head, loaded.model)
    counts = ChainCounts()
    device = head.device
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device=device)
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=loaded.tokenizer.eos_token_id)
        continuation = out[0, len(prompt):].tolist()
        if len(continuation) >= 2:
            counts.add(*chain_counts(model, loaded.model, prompt, continuation, steps))
        if on_prompt is not None:
            on_prompt(i)
    return counts.report()
