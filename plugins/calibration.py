"""A retriever's own acceptance estimate, per kind of lookup and depth, learned from what each step appended.

Counts say how often a continuation followed a match; how often the target then agrees depends most on how long
the match was (measured with SmolLM2 on Spec-Bench summarization, rag and writing: the prompt-local cache's first
token was right 23% of the time after a 1-token match, 93% after an 8-token one, while counts scored both about
0.5). A retriever files each lookup under a group (``match1``, ``match2``, ...) and this corrects its scores per
group and depth. It learns from the tokens a step really appended, whether or not the retriever's nodes were
verified, so it keeps learning while the engine's budget gives a weak group no slots.
"""

from __future__ import annotations

from graft_cli.plugin import Calibration, Step, Tree


def match_group(length: int, cap: int = 4) -> str:
    """The group of a lookup that matched ``length`` context tokens (lengths from ``cap`` on share one)."""
    return f"match{min(length, cap)}"


class LookupCalibration:
    def __init__(self) -> None:
        self.calibration = Calibration()  # kept across requests: it learns this model's habits
        self.pending: dict[int, tuple[Tree, str]] = {}  # context length -> the lookup made there, its group

    def apply(self, tree: Tree, context_length: int, group: str) -> Tree:
        """``tree`` (a lookup's fresh result at ``context_length``, rescored in place) with calibrated scores;
        remembered for observe."""
        tree = self.calibration.apply(tree, group, in_place=True)
        self.pending[context_length] = (tree, group)
        return tree

    def observe(self, step: Step) -> None:
        """Judge the lookup made before this step against the tokens the step appended."""
        lookup = self.pending.get(len(step.context) - len(step.accepted))
        if lookup is not None:
            tree, group = lookup
            self.calibration.observe(tree, tree.follow(step.accepted), group, horizon=len(step.accepted))
        self.pending.clear()
