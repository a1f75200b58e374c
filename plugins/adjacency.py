"""Token Recycling: an adjacency table of every token's likely successors, learnt from the target itself.

``M[x]`` holds the top-k next tokens after ``x`` and their probabilities, as the target saw them the last time it
read ``x``. After every verification the target's distribution at EVERY verified node updates the row of that
node's token, accepted or not, so the candidates the target rejected still teach the table. A lookup walks the
table from the root with an unbalanced template (how many nodes each depth may hold, the greedy chain running
deepest), scoring a path by the product of its probabilities: a real estimate, which the engine calibrates.

The table lives on the model's device as two tensors. ``--adjacency-file`` keeps it across runs (safetensors:
read on first use when it exists, written atomically by :meth:`AdjacencyRetriever.close`, which the proposer's
``close()`` calls; an ``atexit`` hook calls it too, once, if nobody else did).
"""

from __future__ import annotations

import atexit
import os
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from graft_cli.tree import ROOT, Tree
from plugins.base import RetrieverEnv, Step

DEFAULT_TEMPLATE = (8, 10, 8, 6, 5, 4, 4, 4, 3)  # nodes per depth: 52 nodes, depth 9


class AdjacencyRetriever:
    name = "recycling"
    stateless = True  # a lookup reads only the last token: safe on speculative contexts

    def __init__(self, vocab_size: int, device: str = "cpu", k: int = 8,
                 template: Sequence[int] = DEFAULT_TEMPLATE, path: str | None = None) -> None:
        if k < 1 or not template or min(template) < 1:
            raise ValueError("recycling needs k >= 1 and a template of positive widths")
        self.vocab_size, self.k, self.template = vocab_size, k, tuple(template)
        self.device = torch.device(device)
        self.tokens = torch.zeros((vocab_size, k), dtype=torch.int32, device=self.device)
        self.probs = torch.zeros((vocab_size, k), dtype=torch.float32, device=self.device)
        self.path = Path(path).expanduser() if path else None
        self.updates = 0
        self._closed = False
        if self.path is not None:
            if self.path.exists():
                self.load(self.path)
            atexit.register(self.close)

    # --- persistence ------------------------------------------------------------------------------------------
    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        try:
            data = load_file(str(path))
            tokens, probs = data["tokens"], data["probs"]
        except Exception as e:
            raise ValueError(f"adjacency file {path} is unreadable: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if tokens.shape[0] != self.vocab_size or tokens.shape != probs.shape:
            raise ValueError(f"adjacency file {path} is for a vocabulary of {tokens.shape[0]}, not {self.vocab_size}")
        k = min(self.k, tokens.shape[1])
        self.tokens[:, :k] = tokens[:, :k].to(self.device, torch.int32)
        self.probs[:, :k] = probs[:, :k].to(self.device, torch.float32)

    def save(self, path: Path) -> None:
        """Write to a temporary file beside ``path`` and rename it over: a crash never leaves half a table."""
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_file({"tokens": self.tokens.cpu().contiguous(), "probs": self.probs.cpu().contiguous()}, tmp,
                      metadata={"k": str(self.k), "vocab": str(self.vocab_size)})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def close(self) -> None:
        """Save the table to ``--adjacency-file`` (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        if self.path is not None and self.updates:
            self.save(self.path)

    # --- the retriever protocol -------------------------------------------------------------------------------
    def start(self, prompt: Sequence[int]) -> None:
        pass  # the table is global: it carries over from request to request

    @torch.inference_mode()
    def observe(self, step: Step) -> None:
        """Row 0 of the logits is the root's distribution, row i + 1 node i's: each updates its token's row."""
        if step.logits is None or not len(step.accepted):
            return
        if len(step.context) <= len(step.accepted):
            return
        root = step.context[-len(step.accepted) - 1]
        fed = [root, *step.tree.tokens()]
        if step.logits.shape[0] < len(fed):
            return
        rows = step.logits[-len(fed) :]  # the prefill gives only its last row: the root's
        probs = torch.softmax(rows[:, : self.vocab_size].float(), dim=-1)
        values, ids = torch.topk(probs, min(self.k, probs.shape[-1]), dim=-1)
        index = torch.tensor(fed, dtype=torch.long, device=self.device)
        self.tokens[index, : ids.shape[1]] = ids.to(self.device, torch.int32)
        self.probs[index, : values.shape[1]] = values.to(self.device)
        self.updates += 1

    @torch.inference_mode()
    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        """Walk the table from the root: at each depth the best-scoring children of the last depth's nodes,
        as many as the template allows, best first; the whole tree trimmed to ``budget``."""
        tree = Tree()
        if budget <= 0 or not context:
            return tree
        frontier = [(ROOT, int(context[-1]), 1.0)]  # (node, token, path probability)
        for width in self.template:
            if not frontier:
                break
            index = torch.tensor([t for _, t, _ in frontier], dtype=torch.long, device=self.device)
            tokens = self.tokens[index].tolist()
            probs = self.probs[index].tolist()
            candidates = []
            for (node, _, score), succ, p in zip(frontier, tokens, probs):
                for rank, (token, q) in enumerate(zip(succ, p)):
                    if q > 0:
                        candidates.append((score * q, rank, node, token))
            candidates.sort(key=lambda c: (-c[0], c[1]))
            frontier = []
            for score, _, node, token in candidates[:width]:
                frontier.append((tree.add(node, token, self.name, score), token, score))
            if len(tree) >= budget * 2:  # enough to choose the budget's best from
                break
        return tree.select(budget)


def make(env: RetrieverEnv) -> AdjacencyRetriever:
    opts = env.options
    template = opts.get("recycling.template")
    return AdjacencyRetriever(
        env.vocab_size,
        env.device,
        k=int(opts.get("recycling.k", 8)),
        template=tuple(int(w) for w in template.split(",")) if template else DEFAULT_TEMPLATE,
        path=opts.get("adjacency_file") or None,
    )
