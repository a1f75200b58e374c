"""``--draft KIND:SPEC`` to a drafter, through the ``graft.drafters`` entry-point group.

A drafter plugin is a factory: it takes a :class:`DrafterEnv` and returns a
:class:`~graft_cli.graft.Drafter`. The built-ins, ``model`` (a draft LM, ``draft_model.py``) and ``eagle3``
(EAGLE-3 heads, ``eagle3.py``), are registered in pyproject.toml exactly as a third-party package registers its
own (docs/plugins.md).

KIND is the text before the first ``:`` only when a drafter of that name is installed, so a model path that holds
a ``:`` still names a draft model; so does anything with no known kind in front (``--draft qwen2.5-coder-0.5b``
means ``--draft model:qwen2.5-coder-0.5b``). A name in front that is neither installed nor a path is a typo,
or a plugin not installed: that is an error, not a model to look for.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import plugins
from graft_cli.errors import GraftError
from graft_cli.prune import PruneSchedule

if TYPE_CHECKING:
    from graft_cli.graft import Drafter
    from graft_cli.loading import Loaded

DEFAULT_KIND = "model"  # a --draft with no known kind in front
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.+-]+")  # what a kind looks like: no '/', no drive letter


@dataclass(frozen=True)
class DrafterEnv:
    """What a drafter factory gets: the loaded target and the drafting flags (device defaults already applied)."""

    target: Loaded  # the loaded target: .model, .tokenizer, .device
    spec: str  # --draft after "KIND:" (the whole value for a bare model name)
    depth: int  # --depth: tree levels at most
    top_k: int  # --draft-top-k: nodes expanded per level and children per node
    prune: PruneSchedule | None = None  # --prune-at (None: the method does not prune)
    chain: bool = False  # --chain: draft one path
    rope_theta: float | None = None  # --rope-theta (EAGLE-3 heads)
    draft_vocab: int | None = None  # --draft-vocab (draft models)
    draft_window: int | None = None  # --draft-window (draft models): prompt tokens the draft reads at most
    draft_weights: str = "full"  # --draft-weights (draft models): "fp16" (linears over half weights, CPU) or "full"


def kinds() -> list[str]:
    """The installed drafter kinds, sorted."""
    return sorted(plugins.discover(plugins.DRAFTERS))


def parse_draft(draft: str) -> tuple[str, str]:
    """``--draft`` to ``(kind, spec)``; one GraftError line for a kind nobody installed or an empty spec."""
    installed = kinds()
    if DEFAULT_KIND not in installed:  # graft's own entry points: missing only from an install older than them
        raise GraftError("graft's built-in drafters are not registered (installed before pyproject.toml declared "
                         "them): reinstall graft (make install, or pip install -e .)")
    kind, colon, spec = draft.partition(":")
    if colon and kind in installed:
        if not spec:
            raise GraftError(f"--draft {draft}: nothing after '{kind}:' (give --draft {kind}:SPEC)")
        return kind, spec
    if colon and _NAME.fullmatch(kind) and not Path(draft).exists():
        close = difflib.get_close_matches(kind, installed, n=1)
        hint = f"; did you mean {close[0]}:{spec}?" if close else ""
        raise GraftError(f"--draft {draft}: unknown drafter kind '{kind}' (installed: {', '.join(installed) or 'none'}"
                         f"{hint}); a draft model is named without a kind, or as model:NAME")
    if not draft.strip():
        raise GraftError("--draft is empty: give a draft model, or KIND:SPEC")
    return DEFAULT_KIND, draft


def load_drafter(kind: str, env: DrafterEnv) -> Drafter:
    """The drafter of installed ``kind`` over ``env``: a plugin that is missing or broken is one GraftError."""
    return plugins.build(kind, env, plugins.DRAFTERS)
