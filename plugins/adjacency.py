"""Token Recycling: an adjacency table of every token's likely successors, learnt from the target itself.

``M[x]`` holds the top-k next tokens after ``x`` and their probabilities, as the target saw them the last time it
read ``x``. After every verification the target's distribution at EVERY verified node updates the row of that
node's token, accepted or not, so the candidates the target rejected still teach the table. A lookup walks the
table from the root with an unbalanced template (how many nodes each depth may hold, the greedy chain running
deepest), scoring a path by the product of its probabilities: a real estimate, which the engine calibrates.

The table lives on the host (a lookup is a walk of a few dozen small steps: Python, not device launches), as two
CPU tensors with NumPy views. ``observe`` reads nothing back: the top-k of the verified rows is computed on the
model's device and kept there, and the next lookup (or any reading of the table) brings every pending update over
in ONE copy. On the fixed-shape path (graft_cli/runtime/fixed_target.py) the target takes every verified row's
top-k inside its acceptance step and reads it with the step's result (``successors``: this table's k), so
``observe`` writes them straight in and a step reads the device once in all. ``--adjacency-file`` keeps the table across runs (safetensors: read on first use when it exists,
written atomically by :meth:`AdjacencyRetriever.close`, which the proposer's ``close()`` calls; an ``atexit``
hook calls it too, once, if nobody else did).
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from datastores.atomic import atomic_file
from graft_cli.plugin import RetrieverDefaults, RetrieverEnv, Step, Tree, option

DEFAULT_TEMPLATE = (8, 10, 8, 6, 5, 4, 4, 4, 3)  # nodes per depth: 52 nodes, depth 9


class AdjacencyRetriever(RetrieverDefaults):
    name = "recycling"
    stateless = True  # a lookup reads only the last token: safe on speculative contexts
    calibrated = False  # its scores are the target's probabilities; the proposer corrects them
    max_pending = 32  # updates held on the device before they are brought over anyway (memory stays bounded)

    def __init__(self, vocab_size: int, k: int = 8, template: Sequence[int] = DEFAULT_TEMPLATE,
                 path: str | None = None) -> None:
        if k < 1 or not template or min(template) < 1:
            raise ValueError("recycling needs k >= 1 and a template of positive widths")
        if vocab_size >= 1 << 24:  # ids travel to the host in float32, beside their probabilities
            raise ValueError(f"recycling handles vocabularies below 2^24 tokens, not {vocab_size}")
        self.vocab_size, self.k, self.template = vocab_size, k, tuple(template)
        self.successors = k  # the top-k a target that reads it with each step hands over (Step.successors)
        self._tokens = torch.zeros((vocab_size, k), dtype=torch.int32)  # host: the walk runs in NumPy
        self._probs = torch.zeros((vocab_size, k), dtype=torch.float32)  # host
        self._arrays = (self._tokens.numpy(), self._probs.numpy())  # views of the same memory, for the walk
        self._pending: list[tuple[list[int], torch.Tensor]] = []  # (fed tokens, device [n, 2k] ids | probs)
        self.path = Path(path).expanduser() if path else None
        self.updates = 0
        self._closed = False
        if self.path is not None:
            if self.path.exists():
                self.load(self.path)
            atexit.register(self.close)

    @property
    def tokens(self) -> torch.Tensor:
        """``[V, k]`` successor ids (int32, on the host), pending updates applied."""
        self._flush()
        return self._tokens

    @property
    def probs(self) -> torch.Tensor:
        """``[V, k]`` their probabilities (float32, on the host), pending updates applied."""
        self._flush()
        return self._probs

    def _flush(self) -> None:
        """Apply the updates observed on the device since the last flush: one device-to-host copy for all."""
        if not self._pending:
            return
        packed = self._pending[0][1] if len(self._pending) == 1 else torch.cat([p for _, p in self._pending])
        data, start = packed.to("cpu").numpy(), 0  # the one read; the rest is NumPy on the host
        for fed, _ in self._pending:  # in order: later writes win
            self._write(fed, data[start : start + len(fed)])
            start += len(fed)
        self._pending = []

    def _write(self, fed: list[int], block: np.ndarray) -> None:
        """One step's rows ``[len(fed), 2w]`` (ids, then probabilities) into the table; a token fed twice takes
        its last row, as a sequential write would."""
        table, chances = self._arrays
        last = {token: row for row, token in enumerate(fed)}
        rows, block = list(last), block[list(last.values())]
        width = block.shape[1] // 2
        table[rows, :width] = block[:, :width]  # exact: ids travel as float32 (vocab_size < 2^24)
        chances[rows, :width] = block[:, width:]

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
        self.tokens[:, :k] = tokens[:, :k].to(torch.int32)
        self.probs[:, :k] = probs[:, :k].to(torch.float32)

    def save(self, path: Path) -> None:
        """Write to a temporary file beside ``path`` and rename it over: a crash never leaves half a table."""
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            save_file({"tokens": self.tokens.contiguous(), "probs": self.probs.contiguous()}, str(tmp),
                      metadata={"k": str(self.k), "vocab": str(self.vocab_size)})

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
        """Row 0 of the logits is the root's distribution, row i + 1 node i's: each updates its token's row.
        Device ops only, nothing read back; a token fed twice takes its last row (as a sequential write would)."""
        if step.logits is None or not len(step.accepted):
            return
        if len(step.context) <= len(step.accepted):
            return
        root = step.context[-len(step.accepted) - 1]
        fed = [root, *step.tree.tokens()]
        if step.logits.shape[0] < len(fed):
            return
        if step.successors is not None and step.successors.shape == (len(fed), 2 * min(self.k, self.vocab_size)):
            self._flush()  # earlier updates first: later writes win
            self._write(fed, step.successors)  # the target read them with the step (the fixed-shape path)
            self.updates += 1
            return
        logits = step.logits
        if logits.shape != (len(fed), self.vocab_size):  # more rows than fed, or an LM head padded wider
            logits = logits[-len(fed) :, : self.vocab_size]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        values, ids = torch.topk(probs, min(self.k, probs.shape[-1]), dim=-1)
        self._pending.append((fed, torch.cat([ids.to(torch.float32), values], dim=1)))  # ids < 2^24: exact
        self.updates += 1
        if len(self._pending) >= self.max_pending:
            self._flush()

    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        """Walk the table from the root: at each depth the best-scoring children of the last depth's nodes,
        as many as the template allows, best first; the whole tree trimmed to ``budget``.

        A candidate's score is its path probability (0: no candidate, an empty table entry); ties go to the
        better rank, then to the earlier parent."""
        if budget <= 0 or not context:
            return Tree()
        self._flush()
        table, chances = self._arrays
        tokens, scores, width_now, total = np.array([int(context[-1])]), np.ones(1), 1, 0
        found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per depth: tokens, parents, scores
        for width in self.template:
            # [k, F]: rank-major, so a stable sort breaks ties by rank; float64 (the scores' type) from here on
            candidates = (chances[tokens].T * scores).ravel()  # an empty entry (probability 0) stays 0
            order = np.argsort(-candidates, kind="stable")[:width]
            if candidates[order[-1]] <= 0:  # best first: only a short row's tail can be empty
                order = order[candidates[order] > 0]
                if not len(order):
                    break
            parents = order % width_now  # candidate o is rank o // F of parent o % F
            tokens, scores = table[tokens[parents], order // width_now], candidates[order]
            found.append((tokens, parents + (total - width_now) if total else np.full(len(order), -1), scores))
            width_now, total = len(order), total + len(order)
            if total >= budget * 2:  # enough to choose the budget's best from
                break
        if not found:
            return Tree()
        columns = [np.concatenate(column).tolist() for column in zip(*found)]
        return Tree.from_arrays(*columns, self.name).select(budget)


def make(env: RetrieverEnv) -> AdjacencyRetriever:
    template = option(env, "template", None)
    return AdjacencyRetriever(
        env.vocab_size,
        k=option(env, "k", 8, int),
        template=tuple(int(w) for w in template.split(",")) if template else DEFAULT_TEMPLATE,
        path=option(env, "adjacency_file", None),
    )
