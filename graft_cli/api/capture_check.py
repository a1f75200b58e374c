"""The captured path checked against the eager one the first time it runs, once per (model, dtype, device,
method), and the verdict kept beside the latency profile.

On a GPU the fixed-shape path replays CUDA graphs (graft_cli/runtime/graphs.py). A graph that reads a stale
buffer, a bucket padded wrongly or a mask built for another length would change the text silently, on the users'
platform. So before the first request of a method, graft decodes a short fixed prompt twice: plain decoding on the
eager path, which records its margins (graft_cli/runtime/lossless.py), and the method on the captured path. The
tokens must be identical, or differ first where plain decoding's top two logits were tied within the dtype's
tolerance, as ``graft bench`` judges (a tie is kept in the verdict with its margin). Otherwise, or if the captured
run fails, the caller switches the captured path off for that key, with one line on stderr saying why, and goes on
eagerly.

The verdict is a small JSON file named like the latency profile (``graft_home()/profiles/``), one per method, and
holds the graft and torch versions it was made with: another version checks again. The check costs two decodes
of ``NEW_TOKENS`` tokens (the captured one records the graphs its shapes need, which the first request would
record anyway); ``seconds`` in the verdict is what it took.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from datastores.atomic import write_text_atomic
from graft_cli.catalog.checksums import model_checksum
from graft_cli.core import GraftError, Proposer
from graft_cli.core.version import __version__
from graft_cli.drafting.profile import device_label, profile_path
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.method.config import MethodConfig
from graft_cli.runtime.engine import decode
from graft_cli.runtime.fixed_target import FixedShapeTarget
from graft_cli.runtime.loading import Loaded, encode
from graft_cli.runtime.lossless import MarginTarget, first_difference, tie_tolerance
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target

# repetitive on purpose: retrieval finds it, so the method verifies trees of several buckets, not only chains
PROMPT = "Repeat this line four times, numbered: the quick brown fox jumps over the lazy dog."
NEW_TOKENS = 48
VERDICT_VERSION = 1


@dataclass
class Verdict:
    ok: bool
    reason: str  # why not ok; empty when ok
    method: str
    tokens: int  # tokens compared
    seconds: float  # what the check took, both decodes
    ties: list[dict] = field(default_factory=list)  # a difference judged a floating-point tie, with its margin
    graft: str = __version__
    torch: str = torch.__version__
    version: int = VERDICT_VERSION


def captured(target: Target) -> bool:
    """Whether ``target``'s steps replay captured graphs (the fixed-shape path with a capture: CUDA)."""
    return isinstance(target, FixedShapeTarget) and target.graphs.capture is not None


def method_key(config: MethodConfig) -> str:
    """What a verdict is kept for besides the model, dtype and device: the method and its drafter."""
    return config.method + (f"+{config.draft}" if config.draft else "")


def verdict_path(loaded: Loaded, config: MethodConfig) -> Path | None:
    """Beside the latency profile of ``loaded``: one file per method; None for a model with no checksum."""
    try:
        checksum = model_checksum(loaded.path)
    except GraftError:
        return None
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    profile = profile_path(checksum, device_label(loaded.device), dtype)
    key = method_key(config)
    slug = re.sub(r"[^A-Za-z0-9.+-]+", "_", key)[:60] + "-" + hashlib.sha256(key.encode()).hexdigest()[:8]
    return profile.with_name(f"{profile.stem}-captured-{slug}.json")


def check(loaded: Loaded, config: MethodConfig, target: Target, proposer: Proposer,
          new_tokens: int = NEW_TOKENS) -> Verdict:
    """Decode ``PROMPT`` on the eager path (plain decoding, with its margins) and with ``proposer`` over the
    captured ``target``, and judge the difference as ``graft bench`` does."""
    t0 = time.perf_counter()
    ids = encode(loaded.tokenizer, PROMPT)
    reference = MarginTarget(loaded.model)
    want = [t for step in decode(reference, GraftProposer(0), ids, Sampling(), new_tokens, set()) for t in step]
    margins = reference.margins()
    del reference  # its cache, before the captured run reserves its own
    key = method_key(config)
    try:
        got = [t for step in decode(target, proposer, ids, Sampling(), new_tokens, set()) for t in step]
    except Exception as e:  # noqa: BLE001 -- whatever breaks the captured run, the eager path goes on
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return Verdict(False, f"the captured run failed ({type(e).__name__}: {reason})", key, len(want),
                       round(time.perf_counter() - t0, 3))
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    tolerance = tie_tolerance(dtype)
    diff = first_difference(got, want, margins, tolerance)
    seconds = round(time.perf_counter() - t0, 3)
    if diff is None:
        return Verdict(True, "", key, len(want), seconds)
    if diff.tie:
        return Verdict(True, "", key, len(want), seconds, [{"position": diff.position, "margin": diff.margin}])
    margin = "not recorded" if diff.margin is None else f"{diff.margin:.4g} > {tolerance:g}"
    return Verdict(False, f"token {diff.position} of {len(want)} differs from the eager path's (plain decoding's "
                   f"top-2 margin there: {margin})", key, len(want), seconds)


def read_verdict(path: Path | None) -> Verdict | None:
    """A kept verdict of this graft and torch, or None (none kept, unreadable, or made by another version)."""
    if path is None:
        return None
    try:
        verdict = Verdict(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    fresh = Verdict(True, "", "", 0, 0.0)
    same = (verdict.version, verdict.graft, verdict.torch) == (fresh.version, fresh.graft, fresh.torch)
    return verdict if same else None


def first_use(loaded: Loaded, config: MethodConfig, target: Target, proposer: Proposer) -> Verdict | None:
    """The verdict on ``target``'s captured path for this method: kept from an earlier use, else checked now
    and kept. None when ``target`` captures nothing (the eager path, or the fixed-shape path on a CPU). A verdict
    that fails is one line on stderr; the caller goes on eagerly."""
    if not captured(target):
        return None
    path = verdict_path(loaded, config)
    verdict = read_verdict(path)
    if verdict is None:
        verdict = check(loaded, config, target, proposer)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(path, json.dumps(asdict(verdict), indent=1) + "\n")
            except OSError as e:
                print(f"graft: warning: cannot keep the captured path's verdict in {path}: {e.strerror or e}",
                      file=sys.stderr)
    if not verdict.ok:
        print(f"graft: warning: the captured path is off for {verdict.method} on this model, dtype and device: "
              f"{verdict.reason}; generating eagerly (kept in {path}; delete it to check again)", file=sys.stderr)
    return verdict
