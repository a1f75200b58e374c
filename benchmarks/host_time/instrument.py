"""The measurement: a decoding recorded, replayed on the modelled clock, and its host time by phase (what is
wrapped, and why, is in the package's docstring)."""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, replace
from time import thread_time
from typing import Callable

import torch

from graft_cli.core import Clock, Needs, Stats
from graft_cli.drafting import CostAwareProposer, GraftProposer, TreeDrafter
from graft_cli.method.builder import build
from graft_cli.method.config import MethodConfig, parse_draft
from graft_cli.runtime import Loaded, Rule, Sampling, Target, decode
from graft_cli.runtime.fixed_target import FixedShapeTarget
from graft_cli.runtime.kv_cache import PositionCache
from graft_cli.runtime.loading import stop_ids

from benchmarks.host_time.phases import CAPTURED, DEVICE, FORWARD, HostRecorder, Phases
from benchmarks.host_time.playback import Replay, wrapped_forward

QUEUE = "queue"  # the next draft, queued before a step's read: on a GPU, while the device verifies
PHASES = ("propose", "retrieve", QUEUE, "inputs", "verify", "keep", "update", "loop")  # host time, in table order
EXCLUDED = {FORWARD: "model forwards", DEVICE: "vocabulary-wide tensor ops",
            CAPTURED: "regions a GPU replays as CUDA graphs"}
STEP_PHASES = ("propose", "verify", "update", "draft", "retrieve")  # of Stats.times: a request's prefill is no step


@dataclass
class Measured:
    """One timed pass: per phase the host seconds, device reads and torch calls; the seconds the recorder's
    ``Stats.times`` hold (on the modelled clock: the device's, as the decisions saw it); what it decoded."""

    time: Counter
    reads: Counter
    calls: Counter
    modelled: Counter
    steps: int
    tokens: int
    levels: list[int]  # draft levels of each step that drafted
    cost: float = 0.0  # the counting mode's own cost per torch call (subtracted)

    def ms(self, seconds: float) -> float:
        """``seconds`` over the pass, in milliseconds per step."""
        return 1e3 * seconds / max(self.steps, 1)

    @property
    def host_ms(self) -> float:
        return self.ms(sum(self.time[p] for p in PHASES))

    @property
    def exposed_ms(self) -> float:
        """Host time per step the device waits for: all but the draft queued before the read."""
        return self.host_ms - self.ms(self.time[QUEUE])

    @property
    def syncs(self) -> float:
        return sum(self.reads[p] for p in PHASES) / max(self.steps, 1)

    def discount(self, cost: float) -> None:
        """The counting mode's ``cost`` per torch call taken off every phase's time: it is not the host's."""
        self.cost = cost
        for phase, n in self.calls.items():
            self.time[phase] -= n * cost

    def table(self) -> list[str]:
        steps = max(self.steps, 1)
        lines = [f"{'phase':<10}{'ms/step':>10}{'reads/step':>12}{'torch calls/step':>18}"]
        for phase in (*PHASES, *EXCLUDED):
            if self.calls[phase] or self.time[phase]:
                note = f"  {EXCLUDED[phase]}: excluded" if phase in EXCLUDED else ""
                lines.append(f"{phase:<10}{self.ms(self.time[phase]):>10.3f}{self.reads[phase] / steps:>12.2f}"
                             f"{self.calls[phase] / steps:>18.1f}{note}")
        modelled = " ".join(f"{p} {self.ms(self.modelled[p]):.2f}" for p in STEP_PHASES if p in self.modelled)
        lines.append(f"modelled device ms/step (Stats.times, what the decisions read): {modelled}")
        if self.time[QUEUE]:
            lines.append(f"not overlapped with the device: host_ms_per_step={self.exposed_ms:.3f}")
        lines.append(f"host_ms_per_step={self.host_ms:.3f} syncs_per_step={self.syncs:.2f}")
        return lines


class Passes:
    """The target built once and instrumented, and each pass's proposer built afresh (every pass starts from the
    same state) with the host-timing recorder on the modelled clock; ``stack`` undoes the forwards' wrapping."""

    def __init__(self, loaded: Loaded, config: MethodConfig, phases: Phases, replay: Replay, stack: ExitStack,
                 fixed: bool, read_per_level: bool) -> None:
        self.loaded, self.config, self.phases, self.replay, self.stack = loaded, config, phases, replay, stack
        self.kind = parse_draft(config.draft)[0] if config.draft else None
        self.read_per_level, self.stops = read_per_level, stop_ids(loaded)
        target = self.target = FixedShapeTarget(loaded.model) if fixed else Target(loaded.model)
        wrap = phases.wrap  # what a GPU runs as a graph, or while it verifies, apart from the step's host code
        self.forwards(target.model, True, target.cache)
        target.verify = wrap("inputs", target.verify)
        target.keep = wrap("keep", target.keep)
        target.rule = self.queue_timed(target.rule)
        if isinstance(target, FixedShapeTarget):
            target.graphs.run = wrap(CAPTURED, target.graphs.run)
            for inputs in target.inputs.values():
                inputs.write = wrap("inputs", inputs.write)

    def forwards(self, module: torch.nn.Module, target: bool, cache: PositionCache) -> None:
        """``module``'s forward recorded or played back, timed as a forward, until the measurement ends."""
        self.replay.watch(cache)
        wrap, replay = self.phases.wrap, self.replay
        self.stack.enter_context(wrapped_forward(module, lambda own: wrap(FORWARD, replay.wrap(own, target, cache))))

    def queue_timed(self, rule: Callable[..., Rule]) -> Callable[..., Rule]:
        """The target's ``rule`` with the proposer's queue hook (``Needs.queue``, called inside the step before its
        read) timed as its own phase."""

        def timed(sampling: Sampling, noise, needs: Needs, prompt: int) -> Rule:
            if needs.queue is not None:
                needs = replace(needs, queue=self.phases.wrap(QUEUE, needs.queue))
            return rule(sampling, noise, needs, prompt)

        return timed

    def proposer(self) -> GraftProposer:
        """A fresh proposer for ``self.target`` on the modelled clock, its drafter's forwards instrumented."""
        made = build(self.config, self.loaded, self.target, HostRecorder(self.replay.clock, self.phases))
        if isinstance(made, CostAwareProposer):  # as on a GPU: a draft's depth planned before it, one read
            made.objective.planned = not self.read_per_level
        if made.drafter is not None:
            self.drafter(made.drafter)
        return made

    def drafter(self, drafter: TreeDrafter) -> None:
        """The drafter's model forwards (a draft model's, an EAGLE-3 head's layer, fusion and LM head) and, at
        fixed shapes, its captured levels."""
        if drafter.fixed is not None:
            drafter.fixed.graphs.run = self.phases.wrap(CAPTURED, drafter.fixed.graphs.run)
        if self.kind == "eagle3":
            head, replay, wrap = drafter.head, self.replay, self.phases.wrap
            replay.watch(head.cache)
            head.forward, head.fuse, head.logp = (wrap(FORWARD, replay.wrap(fn, False, head.cache))
                                                  for fn in (head.forward, head.fuse, head.logp))
        elif self.kind == "model":
            draft = drafter.cache  # the draft model run as a Target of its own
            for module in (draft.model, draft.model.get_decoder()):
                self.forwards(module, False, draft.cache)
        else:
            raise SystemExit(f"host_time: the forwards of a '{self.kind}' drafter are not known here")

    def decode(self, proposer: GraftProposer, prompt: list[int], max_new: int) -> tuple[Stats, list[int]]:
        """One request, counted from its first step on: its prefill and the proposer's start are paid once a
        request, not a step."""
        stats, phases = Stats(), self.phases
        steps = decode(self.target, proposer, prompt, Sampling(), max_new, self.stops, stats=stats)
        out = list(next(steps))
        phases.counting = True
        with phases.phase("loop"):
            for new in steps:
                out.extend(new)
        phases.counting = False
        return stats, out

    def run(self, prompts: list[list[int]], max_new: int, replaying: bool) -> tuple[Measured, list[list[int]]]:
        """One pass over ``prompts`` after a short warm-up: the record's, or a replay of it."""
        phases = self.phases
        self.replay.begin(replaying)
        phases.replaying, phases.at = replaying, 0
        proposer = self.proposer()
        self.decode(proposer, prompts[0], 8)  # warm-up
        phases.reset()
        modelled, texts, levels, steps, tokens = Counter(), [], [], 0, 0
        for prompt in prompts:
            stats, out = self.decode(proposer, prompt, max_new)
            modelled.update(stats.times)
            steps, tokens = steps + stats.steps, tokens + stats.new_tokens
            texts.append(out)
            levels.extend(record["levels"] for record in proposer.trace if record["levels"])
        proposer.close()
        counts = (Counter(counter) for counter in (phases.time, phases.reads, phases.calls))
        return Measured(*counts, modelled, steps, tokens, levels), texts


def measure(loaded: Loaded, prompts: list[list[int]], config: MethodConfig, max_new_tokens: int = 64, repeat: int = 3,
            in_run: bool = False, target_ms: float = 9.0, draft_share: float = 0.35, read_per_level: bool = False,
            clock: Clock = thread_time, write_kv: bool = False, fixed: bool = False) -> Measured:
    """Decode ``prompts`` with ``config``, its trees chosen by the CUDA latency curve, once for the record and then
    ``repeat`` replays (or, ``in_run``, the record pass timed itself); the quietest timed pass. Of what it wraps
    only the caller's model outlives it: its forward is put back on return."""
    config = replace(config, curve="cuda")  # never this machine's profile, whose forwards would land in the record
    phases, replay = Phases(clock), Replay(target_ms / 1e3, draft_share, write_kv)
    phases.tape = None if in_run else []
    timed, record = [], None
    with ExitStack() as stack:
        passes = Passes(loaded, config, phases, replay, stack, fixed, read_per_level)
        for i in range(1 + (0 if in_run else repeat)):  # the record (timed itself with --in-run), the replays
            cost = phases.cost()  # measured right before each pass: it moves with the machine's state
            with phases:
                m, texts = passes.run(prompts, max_new_tokens, i > 0)
            record = record or texts
            if texts != record:
                raise SystemExit("host_time: the replay produced other tokens than the record")
            if in_run or i > 0:
                m.discount(cost)
                timed.append(m)
    return min(timed, key=lambda m: m.host_ms)
