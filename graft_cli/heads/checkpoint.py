"""Files a training run writes, all atomically (a temporary directory renamed into place, so a killed run leaves
a complete checkpoint or none):

* ``RUN/ckpt-STEP/``: ``state.safetensors`` (fp32 weights, AdamW moments, RNG states), ``state.json`` (step,
  the run's settings, the data position, loss and held-out history) and ``head/``, the head so far in its final
  format. Only the newest checkpoint is kept.
* a head directory in SpecForge's EAGLE-3 layout: ``config.json`` (a ``LlamaConfig`` with
  ``architectures=["LlamaForCausalLMEagle3"]``, ``num_hidden_layers=1``, ``draft_vocab_size``,
  ``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors`` (``fc``, ``midlayer.*``, ``norm``,
  ``lm_head``, ``d2t``, ``t2d``; no ``embed_tokens``: graft uses the target's), plus ``training.json``.

Nothing is unpickled: tensors go through safetensors, the rest through JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from graft_cli.core import GraftError
from graft_cli.heads.model import TrainableHead

PREFIX = "ckpt-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fresh_tmp(final: Path) -> Path:
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, replacing an older ``final`` (moved aside first, then removed)."""
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def head_config(head: TrainableHead, target_config: Any) -> dict:
    """The head's ``config.json`` as SpecForge's ``save_pretrained`` writes it."""
    from transformers import LlamaConfig

    c = head.cfg
    layers = [i - 1 for i in c.layers] if c.layers is not None else None
    config = LlamaConfig(
        hidden_size=c.hidden, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads, head_dim=c.head_dim,
        intermediate_size=c.intermediate, vocab_size=c.vocab, num_hidden_layers=1, rms_norm_eps=c.eps,
        hidden_act=c.act, max_position_embeddings=getattr(target_config, "max_position_embeddings", 2048),
        rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default", **(c.rope_scaling or {})},
        tie_word_embeddings=False, architectures=["LlamaForCausalLMEagle3"],
        bos_token_id=getattr(target_config, "bos_token_id", None), eos_token_id=getattr(target_config, "eos_token_id", None),
        pad_token_id=getattr(target_config, "pad_token_id", None),
    )
    config.draft_vocab_size = c.draft_vocab
    config.target_hidden_size = head.fc.in_features // 3
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True}
    return json.loads(config.to_json_string(use_diff=True))  # what save_pretrained writes


def head_tensors(head: TrainableHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict as stored: floating tensors in ``dtype``, ``d2t`` int64, ``t2d`` bool."""
    return {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
            for k, v in head.state_dict().items()}


def write_head(head: TrainableHead, target_config: Any, out: Path, dtype: torch.dtype, training: dict,
               readme: Callable[[Path], str] | None = None) -> Path:
    """Write a loadable head directory to ``out`` atomically; returns ``out``. ``readme`` (given the written
    weights file) makes a README.md inside it."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = _fresh_tmp(out)
    save_file(head_tensors(head, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(tmp / "model.safetensors", 0o644)  # safetensors writes 0600; a shipped head is read by everyone
    (tmp / "config.json").write_text(json.dumps(head_config(head, target_config), indent=2, sort_keys=True) + "\n")
    (tmp / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    if readme is not None:
        (tmp / "README.md").write_text(readme(tmp / "model.safetensors"))
    _publish(tmp, out)
    return out


def save_checkpoint(run: Path, step: int, head: TrainableHead, optimizer: torch.optim.Optimizer, meta: dict,
                    target_config: Any) -> Path:
    """``RUN/ckpt-STEP`` with everything a resume needs and the head in its final (bf16) format."""
    from safetensors.torch import save_file

    final = run / f"{PREFIX}{step:08d}"
    tmp = _fresh_tmp(final)
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    opt = optimizer.state_dict()
    for i, state in opt["state"].items():
        for name, value in state.items():
            tensors[f"opt.{i}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    save_file(tensors, str(tmp / "state.safetensors"))
    state = {"step": step, "param_groups": opt["param_groups"], **meta}
    (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    write_head(head, target_config, tmp / "head", torch.bfloat16, {"step": step, **meta})
    _publish(tmp, final)
    for old in run.glob(f"{PREFIX}*"):
        if old != final and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    for stale in run.glob(f".{PREFIX}*"):  # temporaries of killed runs
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(run: Path) -> Path | None:
    found = sorted(p for p in Path(run).glob(f"{PREFIX}*") if p.is_dir() and (p / "state.json").is_file())
    return found[-1] if found else None


def load_checkpoint(path: Path, head: TrainableHead, optimizer: torch.optim.Optimizer) -> dict:
    """Restore weights, optimiser and RNG states from ``path`` in place; returns its ``state.json``."""
    from safetensors.torch import load_file

    try:
        state = json.loads((path / "state.json").read_text())
        tensors = load_file(str(path / "state.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        raise GraftError(f"checkpoint {path} is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    model = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    head.load_state_dict(model, strict=True)
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, i, name = key.split(".", 2)
            opt_state.setdefault(int(i), {})[name] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return state


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
