"""The models of a run, each loaded once, the runner of every column on them, and the conversation that fits
every prompt to the target's limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from graft_cli.bench.execution import Conversation, check_reach
from graft_cli.bench.options import BenchOptions
from graft_cli.bench.plan import MethodSpec
from graft_cli.bench.runners import HF_PLD_TOKENS, Columns, build_runners, modules_of, shared_models, weights_dtype
from graft_cli.bench.workload import Workload
from graft_cli.method.config import DEFAULT_KIND, tree_budget
from graft_cli.runtime import loading


@dataclass
class Models:
    target: loading.Loaded
    draft: loading.Loaded | None  # a --draft of the model kind, shared by every method that takes it; other kinds
    # load what they need themselves
    device: str  # where the target's inputs go
    dtype: str  # the target's weights, e.g. float32: what the lossless check's tie tolerance depends on
    forward: str  # whose modules run the target: own (graft's) or transformers
    peer_target: loading.Loaded | None = None  # transformers' copy for its own columns, where the target is graft's


def load_models(opts: BenchOptions, workload: Workload) -> Models:
    """The target on the modules ``--forward`` picks (as ``graft generate`` runs it), a draft model once for every
    column that takes one (hf-assisted and the drafters), and where the target runs on graft's own modules and a
    transformers column is asked for, a transformers copy of the target for it."""
    target = loading.load_model(opts.model, opts.device, opts.dtype, opts.device_map, forward=opts.forward)
    device = target.device
    # a sharded target's draft sits whole where the target's inputs go
    draft_device = device if opts.device_map else opts.device
    draft = (loading.load_model(workload.draft_spec, draft_device, opts.dtype)
             if workload.draft_kind == DEFAULT_KIND else None)
    dtype, modules = weights_dtype(target), modules_of(target)
    peers = modules == "own" and any(spec.kind == "peer" for spec in workload.specs)
    peer_target = loading.load_model(opts.model, opts.device, dtype) if peers else None
    return Models(target=target, draft=draft, device=device, dtype=dtype, forward=modules, peer_target=peer_target)


def build_columns(opts: BenchOptions, workload: Workload, models: Models, warn: Callable[[str], None]) -> Columns:
    """A runner per column that can run here; a drafter that loads its --draft itself gets the loaded copy."""
    with shared_models(models.target, models.draft, models.peer_target):
        return build_runners(workload.specs, models.target, models.draft, opts, workload.explicit, warn,
                             models.peer_target)


def conversation(opts: BenchOptions, workload: Workload, models: Models, specs: list[MethodSpec]) -> Conversation:
    """The prompts' conversation, every prompt fitted to the target's limits with room for the deepest column's
    last forward; without --truncate, every question is checked to fit before any forward runs."""
    tokenizer, stop, limits = models.target.tokenizer, loading.stop_ids(models.target), models.target.limits
    depth = max(reach_depth(s, opts, models) for s in specs)
    conv = Conversation(tokenizer, stop, lambda ids: limits.fit(ids, opts.max_new_tokens, depth, opts.truncate))
    if opts.truncate is None:
        check_reach(workload.questions, Conversation(tokenizer, stop), limits, opts.max_new_tokens, depth)
    return conv


def reach_depth(spec: MethodSpec, opts: BenchOptions, models: Models) -> int:
    """How far past the prompt and its answer a method's last forward reaches: its deepest tree, or the tokens a
    transformers peer looks ahead."""
    if spec.kind == "engine":
        return tree_budget(opts.method_config(spec), models.device)
    if spec.method == "hf-assisted" and models.draft is not None:
        return int(getattr(models.draft.model.generation_config, "num_assistant_tokens", 20) or 20)
    return HF_PLD_TOKENS if spec.method == "hf-pld" else 0
