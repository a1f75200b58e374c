"""What "identical" means, and the check ``graft bench`` (and the tests) run against plain decoding.

Every method computes the same function as plain decoding (``ar``): the same model in the same dtype on the same
device, with the same weights. It does not run the same *kernels*: plain decoding feeds one token with no mask,
tree verification feeds many under a tree mask, and in bf16/fp16 the two sum in different orders. Where the
reference's top two logits are nearly equal, that rounding alone can flip the argmax, and from there the texts
part ways with no bug anywhere. So a difference is judged at its first differing token by the *reference's*
margin there (its top logit minus its second, recorded by the ``ar`` run):

* margin <= ``tie_tolerance(dtype)``: a *floating-point tie*, counted and shown with its margin, not a failure;
* otherwise (or with no margin to judge by): a mismatch, and the run fails.

A flip needs the gap between the top two logits to move by more than the margin, and each logit moves by at most
the largest deviation ``d`` between the two kernels, so the gap moves by at most ``2d``. The tolerances are that
``2d`` measured on a real model (SmolLM2-135M on a CPU, 48 greedy tokens: one-token steps against one 47-token
tree forward; docs/benchmarks.md, "Floating-point ties"), rounded up: fp32 d = 8e-5 (tolerance 1e-3, tight: no
fp32 tie is expected), fp16 d = 0.12 (0.25), bf16 d = 0.72 (1.5: its 8-bit mantissa already rounds a logit
near 20 to a multiple of 0.125). A tie is never hidden: each is listed with its margin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from graft_cli.core import Step, Tree
from graft_cli.runtime.fixed_target import FixedShapeTarget
from graft_cli.runtime.target import Rule, Target

TIE_TOLERANCE = {"float32": 1e-3, "float16": 0.25, "bfloat16": 1.5}


def tie_tolerance(dtype: str | torch.dtype) -> float:
    """The largest reference margin (in logits) at which a difference counts as a floating-point tie."""
    name = str(dtype).replace("torch.", "")
    return TIE_TOLERANCE.get(name, TIE_TOLERANCE["bfloat16"])


@dataclass
class Difference:
    position: int  # the first differing token
    margin: float | None  # the reference's top-1 minus top-2 logit there (None: not recorded)
    tie: bool


def first_difference(got: Sequence[int], want: Sequence[int], margins: Sequence[float] | None,
                     tolerance: float) -> Difference | None:
    """None when the tokens are identical; else where they part and whether the reference was tied there. A
    difference in length alone (one stopped or was cut, the other went on) is never a tie."""
    if list(got) == list(want):
        return None
    pos = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    both = pos < len(got) and pos < len(want)
    margin = float(margins[pos]) if both and margins is not None and pos < len(margins) else None
    return Difference(pos, margin, margin is not None and margin <= tolerance)


class MarginTarget(Target):
    """Plain decoding's target that also keeps, for every token it generates, the margin between its top two
    logits: kept on the device and read back once per generation (:meth:`margins`), so it costs one top-k per
    step and no synchronisation."""

    def __init__(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        self._margins: list[torch.Tensor] = []

    def start(self, prompt: Sequence[int], rule: Rule, capacity: int, kept: int = 0) -> Step:
        step = super().start(prompt, rule, capacity, kept)
        self._margins = [_margin(step.logits[-1])]
        return step

    def step(self, context: list[int], tree: Tree, rule: Rule) -> Step:
        step = super().step(context, tree, rule)
        self._margins.append(_margin(step.logits[0]))  # the root's row: the next token of plain decoding
        return step

    def margins(self) -> list[float]:
        """The margin of each generated token so far (one read from the device)."""
        return [round(m, 5) for m in torch.stack(self._margins).tolist()] if self._margins else []


class FixedMarginTarget(MarginTarget, FixedShapeTarget):
    """Plain decoding's margins on the fixed-shape path (``graft bench --graphs on``: ar runs there too)."""


def _margin(logits: torch.Tensor) -> torch.Tensor:
    top = torch.topk(logits.float(), 2).values
    return top[0] - top[1]


def check_lossless(records: Sequence[dict], baseline: str = "ar", tolerance: float = 0.0) -> list[dict]:
    """Every (question, method) whose tokens differ from the baseline's, at its first differing turn, with the
    first differing index, the baseline's margin there and whether that makes it a floating-point tie."""
    base = {json.dumps(r["question_id"]): r for r in records if r["method"] == baseline}
    out = []
    for r in records:
        b = base.get(json.dumps(r["question_id"]))
        if r["method"] == baseline or b is None:
            continue
        for t, (turn, ref) in enumerate(zip(r["turns"], b["turns"]), start=1):
            diff = first_difference(turn["tokens"], ref["tokens"], ref.get("margins"), tolerance)
            if diff is not None:
                out.append({
                    "question_id": r["question_id"], "category": r["category"], "method": r["method"], "turn": t,
                    "position": diff.position, "tokens": len(turn["tokens"]), "ar_tokens": len(ref["tokens"]),
                    "ar_margin": diff.margin, "tie": diff.tie,
                })
                break  # later turns continue a different conversation
    return out


def report(records: Sequence[dict], dtype: str, baseline: str = "ar") -> dict:
    """results.json's ``lossless``: ok unless a difference is more than a tie; ties listed with their margins."""
    tolerance = tie_tolerance(dtype)
    found = check_lossless(records, baseline, tolerance)
    mismatches = [d for d in found if not d["tie"]]
    return {"ok": not mismatches, "tie_tolerance": tolerance, "dtype": dtype, "mismatches": mismatches,
            "ties": [d for d in found if d["tie"]]}


def describe(d: dict, tolerance: float) -> str:
    """One line for stderr."""
    where = f"{d['method']} differs from ar on question {d['question_id']} ({d['category']}), turn {d['turn']}, " \
            f"token {d['position']}"
    if d["tie"]:
        return f"floating-point tie: {where} (ar's top-2 logit margin there {d['ar_margin']:.4g} <= {tolerance:g})"
    margin = "not recorded" if d["ar_margin"] is None else f"{d['ar_margin']:.4g} > {tolerance:g}"
    return f"not lossless: {where} (ar's top-2 logit margin there: {margin})"
