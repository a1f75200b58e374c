"""``graft heads ship``: a run's newest checkpoint to a head directory fit to ship inside the package: bf16
weights without ``embed_tokens``, the SpecForge config, ``training.json`` and a README giving the command, the
data, the figures and the weights' sha256 (tests/test_heads.py checks the sha256 against the file)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from graft_cli.catalog.resolve import resolve_model
from graft_cli.core import GraftError
from graft_cli.heads import checkpoint as ckpt
from graft_cli.heads.model import TrainableHead
from graft_cli.heads.train import Settings, draft_config


def head_from_checkpoint(path: Path, target_config) -> tuple[TrainableHead, dict]:
    """The head of checkpoint ``path`` (fp32 weights) and its ``state.json``; the target's weights are not needed
    (the head stores no embeddings)."""
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text())
    s = Settings(**state["settings"])
    cfg = draft_config(target_config, s.draft_vocab)
    head = TrainableHead(cfg, target_config.hidden_size, torch.zeros(1, cfg.hidden))
    tensors = load_file(str(path / "state.safetensors"))
    head.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")})
    return head, state


def readme_text(name: str, state: dict, command: str, weights: Path) -> str:
    s = state["settings"]
    last = state["evals"][-1] if state["evals"] else {"loss": None, "acceptance": []}
    loss = state["history"][-1][2] if state["history"] else None
    rows = "\n".join(f"| {k} | {a:.3f} |" for k, a in enumerate(last["acceptance"]))
    size = weights.stat().st_size
    return f"""# {name}

An EAGLE-3 head for `{s['model']}`, trained by graft (`graft heads train`, docs/heads.md). Use it with
`--draft eagle3:{name}`. SpecForge's `LlamaForCausalLMEagle3` layout; no `embed_tokens` (graft uses the
target's; fill it from the target for a strict load elsewhere).

- command: `{command or '(not recorded)'}`
- data: {', '.join(s['data'])} ({state.get('corpus', '')}); 1 document in {s['heldout_every']} held out;
  draft vocabulary {s['draft_vocab']:,} tokens covering {state.get('coverage', 0):.1%} of the training tokens
- recipe: TTT {s['ttt']} steps, step weights {s['step_decay']}^k, sequences of {s['seq_len']} x {s['batch_size']},
  AdamW lr {s['lr']} (warm-up {s['warmup']}, cosine to step {s['max_steps']}), clip {s['grad_clip']}, seed {s['seed']}
- trained: {state['step']:,} steps, {state['tokens']:,} tokens, {state['seconds'] / 3600:.2f} h of wall time in training steps
- final training loss (weighted sum over TTT steps): {loss}; held-out loss {last['loss']}

Held-out top-1 acceptance per TTT step (the head's top-1 equals the target's, teacher-forced):

| step | top-1 |
|---|---|
{rows}

`model.safetensors` ({size / 1e6:.1f} MB, bf16) sha256: `{ckpt.sha256(weights)}`
"""


def ship(run: Path, out: Path, command: str = "") -> Path:
    """Write the head of ``run``'s newest checkpoint to ``out`` (atomically) with its README."""
    from transformers import AutoConfig

    latest = ckpt.latest_checkpoint(run)
    if latest is None:
        raise GraftError(f"no checkpoint under {run}")
    state = json.loads((latest / "state.json").read_text())
    try:
        target_config = AutoConfig.from_pretrained(resolve_model(state["settings"]["model"]))
    except OSError as e:
        raise GraftError(f"cannot read the target's config: {e}") from None
    head, state = head_from_checkpoint(latest, target_config)
    record = {k: v for k, v in state.items() if k != "param_groups"}
    return ckpt.write_head(head, target_config, out, torch.bfloat16, record,
                           readme=lambda weights: readme_text(out.name, state, command, weights))
