"""What a step's tree is chosen by: expected accepted tokens per second of the whole step, drafting included.

A step costs its draft forwards plus one verification; it buys the expected number of accepted tokens, which is
1 (the bonus token) plus the sum of the kept nodes' scores (each node's score estimates the probability that the
target accepts its whole path). Every choice of the tree builder is this one ratio:

- **whether a drafter joins a request**: a draft model reads a request's prompt only when it first drafts. It
  joins when finishing the request at drafting's rate instead of retrieval's rate in this one saves
  ``JOIN_MARGIN`` times what reading the prompt costs, the request expected to run as long again as it has so
  far (at least ``HORIZON`` tokens): a long prompt is read once its answer has shown it is long. Retrieval's
  rate is measured on ``TRIAL`` steps of retrieval alone when the prompt costs more than a target forward to
  read; a shorter one is judged at once, on the first step's retrieval estimate. Drafting's rate is what every
  drafted step of earlier requests reached together (tokens over costs, pooled: a rarely seen confidence bucket
  cannot speak for it). Until drafting has been measured on ``EVIDENCE`` steps it joins at once: what a drafter
  gives is learnt by drafting. A summary's article already holds most of its answer, and then the draft model is
  never paid for;
- **whether to draft at all**: retrieved chains cost nothing to propose. A step whose retrieval is confident may be
  faster without the drafter; the choice is made from the rates that drafting and not drafting have really reached
  at a similar retrieval confidence (a small contextual bandit over measured step times, each mode's rate
  shrunk toward what it is expected to reach there, since accepted lengths are heavy-tailed);
- **how deep and how wide**: another draft level is grown only while what it is expected to add (its frontier's
  path probabilities, the best path's calibrated, times the drafter's usual acceptance of its best child) per
  second of its forward and of verifying its nodes beats the going rate: what drafted steps reach on average
  (the step's own rate until that is measured). There is no fixed depth cap short of ``max_levels``;
- **how many nodes to verify**: the count with the most expected tokens beyond what their verification time
  buys at the going rate (the best rate of the step, until that is measured);
- **the draft's calibration**: how often the target accepts a drafted token, measured per bin of the draft's
  own probability of it given its parent, on the tokens the target read.

Costs are measured while generating: the verification time of each step against the latency curve (the curve's
shape, and its scale in seconds on this device now), and the draft forwards' time by rows fed. Before the first
measurement a draft forward is assumed to cost ``DRAFT_PRIOR`` of a one-token target forward.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from statistics import median
from typing import NamedTuple, Sequence

import numpy as np

from graft_cli.core.defaults import MAX_LEVELS
from graft_cli.drafting.budget import LatencyModel

DRAFT_PRIOR = 0.35  # a draft forward against a one-token target forward, until measured (Qwen 0.5B / 1.5B: 0.33)
CONFIDENCE_PRIOR = 0.8  # the drafter's conditional probability of its best child, until measured
MEMORY = 0.3  # weight of the newest step in a mode's running tokens and costs
WINDOW = 16  # steps whose timings the costs of a forward are the median of
EXPLORE = 8  # a mode that loses in a bucket is still tried every this many visits (conditions change)
EMA_STEPS = (2 - MEMORY) / MEMORY  # the steps a running figure weighs as much as (its effective sample size)
PRIOR_STEPS = 4.0  # the steps a mode's expected rate in a bucket weighs as much as
BUCKETS = 8  # retrieval confidence buckets: expected accepted tokens 1, 2, ..., 8 and more
TRIAL = 3  # steps of retrieval alone before a drafter may join a request whose prompt costs more than a target
# forward to read
EVIDENCE = 16  # drafted steps measured (a bench's warm-up gives a few) before drafting's own rate is trusted
# what joining must save, in multiples of what it costs: both sides are estimated in its favour (a long prompt's
# prefill is priced by the latency curve's last slope, while attention makes it grow faster)
JOIN_MARGIN = 2.0
HORIZON = 32  # new tokens a request is expected to take at the least, when a drafter's joining is judged
# the draft's calibration: how often the target accepts a drafted token, by the draft's own probability of it given
# its parent (bins from these lower edges). A well-aligned draft model is right far more often than its own
# probabilities say at 0.4-0.9 (Qwen2.5-Coder 0.5B under 1.5B on Spec-Bench math: 85-95%), and less often than
# they say at 0.99 and above (98%), so no single power of the probability fits both
EDGES = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99])
CALIBRATION_PRIOR = 2.0  # tokens a bin's prior (the draft's own probability) weighs as much as
FORGET = 0.97  # per drafted step, what the calibration and drafting's pooled rate keep of their past


class RetrievalSoFar(NamedTuple):
    """A request's steps before its drafter joined: what retrieval alone has done there."""

    tokens: int  # accepted tokens
    cost: float  # verification cost, in latency units
    steps: int


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - MEMORY) * old + MEMORY * new


def _given(line: Sequence[float]) -> np.ndarray:
    """Path probabilities along one path to each token's probability given its parent."""
    probs = np.asarray(line, dtype=np.float64)
    return np.clip(probs / np.concatenate(([1.0], probs[:-1])).clip(min=1e-300), 0.0, 1.0)


def _bins(given: np.ndarray) -> np.ndarray:
    """The calibration bin of each probability."""
    return np.searchsorted(EDGES, given, side="right") - 1


@dataclass
class Plan:
    """The best verification set found so far: how many of the ranked nodes, at what rate (tokens per unit)."""

    count: int
    rate: float


@dataclass
class Objective:
    """Running costs and the decisions they make. Units: the latency curve's (seconds for a measured profile,
    one-token forwards for a device default); ``unit`` converts measured seconds into them."""

    latency: LatencyModel
    max_levels: int = MAX_LEVELS  # draft forwards per step at most (depth follows confidence up to here)
    unit: float | None = None  # seconds per latency unit, measured
    draft_unit: float | None = None  # seconds of a one-row draft forward, measured
    confidence: float = CONFIDENCE_PRIOR
    rates: dict = field(default_factory=dict)  # (bucket, drafted) -> running (tokens, verify cost, draft forwards)
    visits: dict = field(default_factory=dict)  # (bucket, drafted) -> steps since that mode last ran there
    steps: dict = field(default_factory=dict)  # (bucket, drafted) -> steps that mode ran there
    drafted_steps: int = 0  # steps measured with a draft
    drafting: tuple[float, float, float] = (0.0, 0.0, 0.0)  # drafted steps pooled: tokens, verify cost, draft shape
    alone: tuple[float, float] = (0.0, 0.0)  # steps of retrieval alone pooled: tokens, and the buckets they expected
    planned: bool = False  # choose the depth before each draft (no read per level: a GPU's queue keeps going)
    levels: int = 0  # planned: the levels the next draft grows (0: max_levels until a draft has been walked)
    _tested: np.ndarray = field(default_factory=lambda: np.zeros(len(EDGES)))  # drafted tokens the target read,
    _passed: np.ndarray = field(default_factory=lambda: np.zeros(len(EDGES)))  # ... and accepted, per bin (decayed)
    _units: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    _draft_units: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    # --- costs --------------------------------------------------------------------------------------------------
    def verify_cost(self, nodes: int) -> float:
        return self.latency(nodes + 1)

    def draft_cost(self, rows: int) -> float:
        """One draft forward of ``rows`` rows, in latency units (the target curve's shape, the draft's scale)."""
        target_one = self.latency(1)
        one = self.draft_unit / self.unit if self.unit and self.draft_unit else DRAFT_PRIOR * target_one
        return one * self.latency(rows) / target_one

    def spent(self, seconds: float, rows: Sequence[int]) -> float:
        """What drafting has cost so far: measured ``seconds`` once the unit is known, else the prior per row."""
        if self.unit:
            return seconds / self.unit
        return sum(self.draft_cost(r) for r in rows)

    # --- decisions ----------------------------------------------------------------------------------------------
    def best(self, scores: np.ndarray, spent: float, line: Sequence[float] = ()) -> Plan:
        """How many of ``scores`` (the drafter's own path probabilities, best first) to verify after ``spent``
        units of drafting, and the rate; ``line``: the probabilities along the best path, which count as
        calibrated (the rest as they are: siblings are rarely what the target picks)."""
        return self._plans(np.asarray(scores, dtype=np.float64)[None], [spent], [self._lift(line)])[0]

    def _plans(self, scores: np.ndarray, spent: Sequence[float], lifts: Sequence[float]) -> list[Plan]:
        """:meth:`best` for each row of ``scores`` ``[R, n]`` (a row shorter than ``n`` padded with zeros), in
        one array pass: ``spent`` and ``lifts`` (what calibrating the best path adds) per row."""
        counts, gains = self.latency.best_counts(0, 0.0, scores, np.asarray(spent, dtype=np.float64), self.going())
        return [Plan(count, (gain + lift) / (cost + self.verify_cost(count)))
                for count, gain, lift, cost in zip(counts.tolist(), gains.tolist(), lifts, spent)]

    def _lift(self, line: Sequence[float]) -> float:
        """What calibrating the best path's probabilities adds to their sum."""
        return float(np.sum(self.calibrated(line)) - np.sum(line)) if len(line) else 0.0

    def extend(self, frontier: Sequence[float], plan: Plan, spent: float, line: Sequence[float] = ()) -> bool:
        """Whether one more draft level over ``frontier`` (its path probabilities, best first) raises the
        step's rate: the best node's child counts as calibrated, the others' as they are. ``line``: the best
        path's probabilities down to ``frontier[0]`` (that node alone when not given), which calibrate it."""
        if not len(frontier):
            return False
        best = self.calibrated(line if len(line) else frontier[:1])[-1]
        gain = self.confidence * (best + sum(frontier[1:]))
        cost = self.draft_cost(len(frontier)) + self.verify_cost(plan.count + len(frontier)) - self.verify_cost(plan.count)
        going = self.going()
        return gain > (plan.rate if going is None else going) * cost

    def going(self) -> float | None:
        """What a unit of time is worth when deciding on more of a step (another level, another node): drafting's
        pooled rate once measured on ``EVIDENCE`` steps, else unknown (None: the step's own rate decides).
        Generation's throughput is tokens over all the time spent, so more of a step pays when it beats what the
        time buys on average; the step's own rate would stop a step that goes well short (Spec-Bench math on the
        Qwen pair: 57 of 93 drafts were accepted whole) and, its drafting sunk, verify weak nodes after it."""
        return self.drafting_rate() if self.drafted_steps >= EVIDENCE else None

    def replan(self, levels: Sequence[tuple[Sequence[float], Sequence[float]]], rows: Sequence[int]) -> int:
        """A planned draft's levels, read once at its end: per level grown, the frontier's cumulative log-probs
        and the pool's best then; ``rows``: the rows of each forward. The levels are walked as the per-level rule
        walks them, and where it would have stopped is the next draft's depth (one level deeper when it would
        have gone on). Returns how many of the pool's best nodes to keep."""
        if not levels:
            return 0
        best = np.full((len(levels), max(len(b) for _, b in levels)), -math.inf)
        for i, (_, ranked) in enumerate(levels):
            best[i, : len(ranked)] = ranked
        paid = list(accumulate((self.draft_cost(r) for r in rows), initial=0.0))
        spent = [paid[min(level, len(rows))] for level in range(1, len(levels) + 1)]
        line = [math.exp(cum[0]) for cum, _ in levels if cum]  # the best path, one node a level (its newest: cum[0])
        # what calibrating the best path adds, by how many of its nodes a level has walked (one pass over the path)
        added = np.concatenate(([0.0], np.cumsum(self.calibrated(line) - np.asarray(line)))) if line else np.zeros(1)
        walks = list(accumulate(1 if cum else 0 for cum, _ in levels))
        lifts = [float(added[w]) for w in walks]
        plans = self._plans(np.exp(best), spent, lifts)
        stop, last = 0, None
        for level, ((cum, _), plan, walked) in enumerate(zip(levels, plans, walks), start=1):
            if cum:  # the confidence is learnt level by level, as the per-level rule learns it
                if last is not None:
                    self.observe_confidence(last, cum[0])
                last = cum[0]
            if not stop and (level >= self.max_levels or not self.extend([math.exp(c) for c in cum], plan,
                                                                          spent[level - 1], line[:walked])):
                stop = level
        self.levels = stop or min(self.max_levels, len(levels) + 1)
        return plans[-1].count

    def bucket(self, retrieved: np.ndarray) -> int:
        """Retrieval's confidence this step: the expected accepted tokens of its own best tree, rounded."""
        plan = self.best(retrieved, 0.0)
        return min(BUCKETS, int(round(1.0 + float(np.sum(retrieved[: plan.count])))))

    def should_draft(self, bucket: int) -> bool:
        """Draft unless not drafting has measured faster at this retrieval confidence. Each mode is tried first
        while unmeasured, and the losing one again every ``EXPLORE`` visits; retrieval alone only where its
        expected rate could win (in bucket 1 it is plain decoding: trying it there only loses a step)."""
        drafted, skipped = self.rate(bucket, True), self.rate(bucket, False)
        if drafted is None:
            return True
        if skipped is None or (drafted >= skipped and self.visits.get((bucket, False), 0) >= EXPLORE):
            return self.expected(bucket, False) < drafted
        if drafted < skipped and self.visits.get((bucket, True), 0) >= EXPLORE:
            return True
        return drafted >= skipped

    def should_join(self, alone: RetrievalSoFar, rows: int, remaining: int,
                    retrieved: Sequence[float] = ()) -> bool:
        """Whether a drafter that has not read this request yet should read its ``rows`` tokens and draft:
        ``alone`` is this request's steps so far (accepted tokens, verification cost, steps), ``remaining`` the
        new tokens still to come, ``retrieved`` this step's calibrated retrieved scores. Always while drafting
        has been measured on fewer than ``EVIDENCE`` steps: what it gives is learnt by drafting (no prior tells a
        draft model that agrees with its target 97% of the time on code from one that rarely does).

        Retrieval's rate is measured on ``TRIAL`` steps first when reading the prompt costs more than a target
        forward (a summary's article). A prompt cheaper to read than that is judged at once, on this step's
        retrieval estimate (plus the steps so far): a wrong join then costs less than one trial step wastes."""
        if self.drafted_steps < EVIDENCE:
            return True
        tokens, cost, steps = alone
        reading = self.draft_cost(rows)
        if steps < TRIAL:
            if reading > self.verify_cost(0):
                return False
            plan = self.best(retrieved, 0.0)
            here = self.verify_cost(plan.count)
            tokens, cost = tokens + plan.rate * here, cost + here
        saved = remaining * (cost / max(tokens, 1) - 1.0 / self.drafting_rate())  # latency units, at each rate
        return saved > JOIN_MARGIN * reading

    @staticmethod
    def expected_remaining(written: int, most: int) -> int:
        """The new tokens a request is expected still to take, ``written`` taken and ``most`` the limit: as many
        again (an answer's length is unknown, and one that has run ``g`` tokens is as likely to end within ``g``
        more as to run past them), at least ``HORIZON``. Assuming the limit instead made the draft model read
        700-token rag prompts for 12-20-token answers."""
        return min(most, max(written, HORIZON))

    def drafting_rate(self) -> float:
        """Accepted tokens per latency unit of the drafted steps measured so far: pooled (a rarely seen
        confidence bucket cannot speak for drafting), at the current costs."""
        tokens, verify, shape = self.drafting
        return tokens / (verify + shape * self.draft_cost(1))

    def retrieval_share(self) -> float:
        """What steps of retrieval alone accepted against what their buckets expected, pooled (one step of exact
        expectations as the prior): retrieval's estimates run high where a prompt repeats numbers, not answers."""
        tokens, expected = self.alone
        return (tokens + 1.0) / (expected + 1.0)

    # --- measurements -------------------------------------------------------------------------------------------
    def measured(self, bucket: int, drafted: bool, tokens: int, nodes: int, verify_s: float, draft_s: float,
                 draft_rows: Sequence[int]) -> None:
        """One step's outcome: ``tokens`` accepted from a ``nodes``-node tree verified in ``verify_s`` seconds,
        after ``draft_s`` seconds of draft forwards of ``draft_rows`` rows.

        The seconds calibrate the costs as medians of recent steps (a warm-up forward or a busy moment of a
        shared machine does not move them); a mode's rate is its accepted tokens over what its steps cost at the
        current costs, so the comparison between modes is between like costs."""
        shape = sum(self.latency(r) for r in draft_rows) / self.latency(1)
        if verify_s > 0:
            self._units.append(verify_s / self.verify_cost(nodes))
            self.unit = median(self._units)
        if shape and draft_s > 0:
            self._draft_units.append(draft_s / shape)
            self.draft_unit = median(self._draft_units)
        key = (bucket, drafted)
        self.drafted_steps += drafted
        verify = self.verify_cost(nodes)
        if drafted:
            self.drafting = tuple(FORGET * old + new for old, new in zip(self.drafting, (tokens, verify, shape)))
        else:
            self.alone = (FORGET * self.alone[0] + tokens, FORGET * self.alone[1] + bucket)
        old = self.rates.get(key, (None, None, None))
        self.rates[key] = (_ema(old[0], tokens), _ema(old[1], verify), _ema(old[2], shape))
        self.steps[key] = self.steps.get(key, 0) + 1
        self.visits[key] = 0
        self.visits[(bucket, not drafted)] = self.visits.get((bucket, not drafted), 0) + 1

    def rate(self, bucket: int, drafted: bool) -> float | None:
        """Accepted tokens per latency unit that steps of this mode reached at this retrieval confidence, shrunk
        toward :meth:`expected` (``PRIOR_STEPS`` steps of it against the running figure's few). Accepted lengths
        are heavy-tailed, so one failed draft in a bucket would otherwise shut drafting out of it for ``EXPLORE``
        visits (Spec-Bench coding on the Qwen pair: steps of retrieval alone at 1-2 tokens, where drafting
        averaged 8)."""
        if (bucket, drafted) not in self.rates:
            return None
        tokens, verify, forwards = self.rates[(bucket, drafted)]
        measured = tokens / (verify + forwards * self.draft_cost(1))
        weight = min(self.steps[(bucket, drafted)], EMA_STEPS)
        return (weight * measured + PRIOR_STEPS * self.expected(bucket, drafted)) / (weight + PRIOR_STEPS)

    def expected(self, bucket: int, drafted: bool) -> float:
        """The rate a mode is expected to reach at this retrieval confidence before its own steps there say:
        drafting's pooled rate, or the bucket's expected tokens (scaled by what retrieval alone has delivered
        of its expectations) over a one-token forward."""
        return self.drafting_rate() if drafted else bucket * self.retrieval_share() / self.verify_cost(0)

    def calibrated(self, line: Sequence[float]) -> np.ndarray:
        """The draft's path probabilities along one path (each node's, from the first level down) as acceptance
        estimates: the product of each token's calibrated acceptance given its parent."""
        return np.cumprod(self.accepts(_given(line)))

    def accepts(self, given: np.ndarray) -> np.ndarray:
        """How often the target accepts a drafted token that the draft gave probability ``given`` after its
        parent: its bin's measured rate, the draft's own probability weighing ``CALIBRATION_PRIOR`` tokens."""
        given = np.clip(given, 0.0, 1.0)
        bins = _bins(given)
        return (self._passed[bins] + CALIBRATION_PRIOR * given) / (self._tested[bins] + CALIBRATION_PRIOR)

    def observe_draft(self, line: Sequence[float], accepted: int) -> None:
        """The draft's own probabilities along its best path of a verified tree, and how far along it the
        target accepted: every token the target read (those up to and including the first it rejected) is
        counted in its bin, accepted or not; the tokens after a rejected one were never read (the best path is
        what depth is chosen for; siblings are rarely what the target picks)."""
        if not len(line):
            return
        bins = _bins(_given(line)[: accepted + 1])  # the tokens the target read
        self._tested *= FORGET
        self._passed *= FORGET
        np.add.at(self._tested, bins, 1.0)
        np.add.at(self._passed, bins[:accepted], 1.0)

    def observe_confidence(self, parent_logp: float, child_logp: float) -> None:
        """The drafter's best child against its best parent one level up (log path probabilities): the running
        acceptance expected of the next level's best token."""
        if math.isfinite(parent_logp) and math.isfinite(child_logp):
            given = np.array([min(1.0, math.exp(child_logp - parent_logp))])
            self.confidence = _ema(self.confidence, float(self.accepts(given)[0]))
