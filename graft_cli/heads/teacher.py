"""The target as teacher, run online without gradients: per batch, its fused hidden states (what the head reads)
and its next-token distribution restricted to the draft vocabulary (what the head learns). Full-vocabulary
logits exist only a chunk of rows at a time; nothing vocabulary-sized is kept per token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graft_cli.heads.data import Batch
from graft_cli.heads.model import context_mask

LOGIT_ROWS = 512


@dataclass
class Lesson:
    features: torch.Tensor  # [B, L, 3·Ht] hidden states of the three layers, low | mid | high
    probs: torch.Tensor  # [B, L, Vd] the target's next-token distribution over the draft vocabulary (renormalised)
    argmax: torch.Tensor  # [B, L] the target's greedy next token (target ids)


@torch.no_grad()
def teach(target: torch.nn.Module, batch: Batch, layers: tuple[int, ...], draft_ids: torch.Tensor,
          autocast: torch.dtype | None = None, full: bool = True) -> Lesson:
    """One forward of ``target`` over a packed batch (documents masked from each other, their own positions).
    ``full``: the greedy token over the whole vocabulary (evaluation); else over the draft vocabulary only, which
    skips the full-vocabulary logits (training: a sixth of the step on SmolLM2's 49k vocabulary)."""
    device = batch.tokens.device
    dtype = next(target.parameters()).dtype
    mask = context_mask(batch.docs, dtype)
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        out = target.model(input_ids=batch.tokens, attention_mask=mask, position_ids=batch.positions,
                           output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states
    features = torch.cat([hidden[i] for i in layers], dim=-1).float()
    last = out.last_hidden_state.flatten(0, 1)
    weight = target.get_output_embeddings().weight
    draft_weight = None if full else weight.index_select(0, draft_ids)
    probs, argmax = [], []
    for rows in last.split(LOGIT_ROWS):
        if full:
            logits = torch.nn.functional.linear(rows.to(weight.dtype), weight).float()
            argmax.append(logits.argmax(-1))
            logits = logits.index_select(-1, draft_ids)
        else:
            logits = torch.nn.functional.linear(rows.to(weight.dtype), draft_weight).float()
            argmax.append(draft_ids[logits.argmax(-1)])
        probs.append(torch.softmax(logits, dim=-1))
    shape = batch.tokens.shape
    return Lesson(features, torch.cat(probs).view(*shape, -1), torch.cat(argmax).view(shape))
