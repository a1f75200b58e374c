"""`make demo`'s verdict on the two texts: identical, a floating-point tie reported with its margin, or a failure."""

from __future__ import annotations

import torch

from benchmarks.demo import verdict


def test_identical_a_tie_and_a_mismatch():
    assert verdict([1, 2, 3], [1, 2, 3], [5.0, 5.0, 5.0], torch.float32) == ("identical text: yes", True)
    line, kept = verdict([1, 2, 4], [1, 2, 3], [5.0, 5.0, 0.125], torch.bfloat16)
    assert kept and line.startswith("identical text: up to a floating-point tie in bfloat16 at token 2")
    assert "0.125 <= 1.5" in line
    assert verdict([1, 2, 4], [1, 2, 3], [5.0, 5.0, 3.0], torch.bfloat16) == ("identical text: NO", False)
    assert verdict([1, 2, 4], [1, 2, 3], [5.0, 5.0, 0.125], torch.float32) == ("identical text: NO", False)
