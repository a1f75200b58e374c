"""EAGLE-3 heads trained by graft (graft_cli/heads/): the training-time test is the drafter's own computation,
the loss falls, checkpoints resume bit-exactly (also after a real SIGKILL), the files load in graft and in
SpecForge's reference class, and the shipped head matches its README."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graft_cli.drafters.eagle3 import load_head
from graft_cli.heads import checkpoint as ckpt
from graft_cli.heads.data import Batch
from graft_cli.heads.model import context_mask, step_inputs
from graft_cli.heads.teacher import teach
from graft_cli.heads.train import draft_config, new_head
from tests.test_eagle3 import target_model
from tests.tiny import VOCAB


def tiny_head(target, draft_vocab=40, seed=1, noise=0.05):
    ids = torch.arange(draft_vocab) * 2 + 1  # a real reduced vocabulary: odd target ids
    head = new_head(target, draft_config(target.config, draft_vocab), ids, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return head


def one_document(tokens):
    t = torch.tensor([tokens])
    return Batch(t, torch.arange(len(tokens))[None], torch.zeros_like(t))


def test_ttt_steps_are_the_drafters_chain(tmp_path):
    """Step k of the unrolled training at row t equals the loaded head drafting depth k from position t."""
    target = target_model()
    head = tiny_head(target)
    tokens = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    batch = one_document(tokens)
    lesson = teach(target, batch, head.cfg.layers, head.draft_ids())
    context = context_mask(batch.docs, torch.float32)
    with torch.no_grad():
        logits = head.unroll(lesson.features, [step_inputs(batch.tokens, batch.positions, k, context) for k in range(3)])
    ckpt.write_head(head, target.config, tmp_path / "h", torch.float32, {})
    infer = load_head(str(tmp_path / "h"), target)
    t = 5
    infer.reset()
    fused = infer.fuse(lesson.features[0, : t + 1])
    rows = torch.arange(t + 1)
    out = infer.forward(torch.tensor(tokens[1 : t + 2]), fused, rows, torch.ones(t + 1, t + 1, dtype=torch.bool).tril())
    state = out[t : t + 1]
    torch.testing.assert_close(infer.logp(state)[0], torch.log_softmax(logits[0][0, t], -1), atol=1e-5, rtol=1e-5)
    for k in (1, 2):
        allowed = torch.ones(1, infer.length + 1, dtype=torch.bool)
        state = infer.forward(torch.tensor([tokens[t + 1 + k]]), state, torch.tensor([t + k]), allowed)
        torch.testing.assert_close(infer.logp(state)[0], torch.log_softmax(logits[k][0, t], -1), atol=1e-5, rtol=1e-5)
