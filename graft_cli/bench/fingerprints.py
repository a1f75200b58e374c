"""The fingerprint of each column: a hash of everything that makes its figures what they are (the model, the
questions, the settings, the draft), so that ``--resume`` and ``--report-only`` keep only the recorded runs of
the same configuration. What goes in may grow only where its absence meant the old default: runs recorded
before then keep their fingerprints."""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

from graft_cli.bench.models import Models
from graft_cli.bench.options import BenchOptions
from graft_cli.bench.plan import MethodSpec, uses_draft
from graft_cli.bench.provenance import Provenance
from graft_cli.method.config import drafting_for
from graft_cli.runtime.fixed_target import use_compiler, use_graphs


def fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprints(opts: BenchOptions, specs: Sequence[MethodSpec], models: Models,
                 provenance: Provenance) -> dict[str, str]:
    """Each column's fingerprint, by name."""
    common = _common(opts, models, provenance)
    return {s.name: fingerprint(_parts(s, common, opts, models, provenance)) for s in specs}


def _common(opts: BenchOptions, models: Models, provenance: Provenance) -> dict:
    """What every column shares: the model, the questions, the length of the answers, the machine."""
    common = {"model": provenance.model_checksum, "dataset": provenance.dataset_sha,
              "max_new_tokens": opts.max_new_tokens, "device": models.device, "dtype": models.dtype,
              "threads": provenance.environment["device"]["torch_threads"]}
    if opts.truncate:  # cut prompts are other prompts
        common["truncate"] = opts.truncate
    if opts.repeats > 1:  # the fastest of several rounds is another figure than one round's
        common["repeats"] = opts.repeats
    if models.forward == "own":  # graft's own modules: another execution than transformers' (runs before were)
        common["forward"] = "own"
    if use_graphs(opts.graphs, models.device):  # another execution of the same method; runs before were eager
        common["graphs"] = True
    if use_compiler(opts.graphs, models.device):  # compiled kernels: another execution again
        common["compiled"] = True
    return common


def _parts(spec: MethodSpec, common: dict, opts: BenchOptions, models: Models, provenance: Provenance) -> dict:
    """One column's: the common parts, its spec, its draft, and for an engine method its settings."""
    parts = dict(common, spec=spec.as_dict())
    if uses_draft(spec):
        parts.update(draft=provenance.draft_checksum)
    if spec.kind == "engine" and spec.method != "ar":
        parts.update(options=opts.options)
        if opts.method_opts:
            parts.update(method_opts=opts.method_opts)
        if provenance.token_ranking_sha and uses_draft(spec):
            parts.update(token_ranking=provenance.token_ranking_sha)
        if models.draft and uses_draft(spec):  # a half-weight draft is another draft; runs before it were full
            weights = drafting_for(opts.method_config(spec), models.device)[0].draft_weights
            if weights != "full":
                parts.update(draft_weights=weights)
    return parts
