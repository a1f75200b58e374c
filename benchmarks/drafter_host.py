"""TreeDrafter's own host time per draft, model forwards taken out, at the CUDA defaults (budget 60, depth 7,
top-k 8; dense and the CUDA pruning schedule).

A real decode (SmolLM2-135M drafting for itself, or a random EAGLE-3 head over it, its LM head scaled so that
trees grow deep) records what every ``_root``/``_grow`` returned; each draft is then replayed through a stub that
returns those tensors at once, so only the expansion, selection and bookkeeping are timed (this thread's CPU
time, best of 5, median over the drafts), and their device-to-host reads are counted with tests/test_device.py's
``Discipline``. "top-64 columns" replays only each row's best 64 log-probabilities, which leaves the tree
unchanged but takes the top-k over the whole vocabulary (a kernel on a GPU) off the CPU.

    python benchmarks/drafter_host.py

benchmarks/host_overhead.py measures the whole step; its ``draft`` phase also holds the draft cache's
compaction and the draft model's mask building, which this leaves out.
"""
import sys
import tempfile
from pathlib import Path
from time import thread_time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

torch.set_num_threads(1)
from graft_cli.drafters import TreeDrafter  # noqa: E402
from graft_cli.drafters.draft_model import DraftModelDrafter
from graft_cli.drafters.eagle3 import Eagle3Drafter, load_head
from graft_cli.engine import decode
from graft_cli.graft import GraftProposer
from graft_cli.loading import encode, load_model
from graft_cli.prune import PruneSchedule
from graft_cli.sampling import Sampling
from graft_cli.stats import Stats
from graft_cli.target import Target
from tests.test_device import Discipline
from tests.test_eagle3 import write_head


class Replay(TreeDrafter):
    """Returns the recorded (logp, state) of each call; with narrow columns, only each row's best ``narrow``
    log-probs (sorted), so that the top-k over the vocabulary (a kernel on a GPU) costs the CPU nothing."""

    def __init__(self, calls, to_target, narrow=0, **kw):
        super().__init__(**kw)
        self.calls, self.convert, self.i, self.narrow = calls, to_target, 0, narrow

    def _next(self):
        logp, state, self.cols = self.calls[self.i]
        self.i += 1
        return logp, state

    def _to_target(self, ids):
        return self.convert(torch.gather(self.cols, -1, ids) if self.narrow else ids)

    def _root(self, context):
        return self._next()

    def _grow(self, tokens, states, depth, mask):
        return self._next()

    def _drop_tree(self, keep_rows):
        self.tree_rows = 0


def record(loaded, drafter, prompt, tokens):
    drafts = []
    for name in ("_root", "_grow"):
        inner = getattr(drafter, name)
        def recorded(*a, _inner=inner, _name=name):
            out = _inner(*a)
            if _name == "_root":
                drafts.append([])
            drafts[-1].append(out)
            return out
        setattr(drafter, name, recorded)
    proposer = GraftProposer(60, drafter=drafter)
    list(decode(Target(loaded.model), proposer, prompt, Sampling(), tokens, set(), None))
    return drafts


def narrowed(logp, state, narrow):
    """(log-probs, state, their columns): each row's best ``narrow`` only, or all of them (columns None)."""
    if not narrow:
        return logp, state, None
    values, columns = torch.topk(logp, narrow, dim=-1)
    return values, state, columns


def replay(drafts, to_target, narrow=0, **kw):
    times, reads, levels = [], 0, 0
    for calls in drafts:
        calls = [narrowed(logp, state, narrow) for logp, state in calls]
        best = None
        for _ in range(5):
            d = Replay(calls, to_target, narrow, **kw)
            t = thread_time()
            d.draft([0], 60, Stats())
            best = min(best or 1e9, thread_time() - t)
        times.append(best)
        d = Replay(calls, to_target, narrow, **kw)
        mode = Discipline(scope=("graft_cli/",), strict=False)
        with mode:
            d.draft([0], 60, Stats())
        reads += mode.reads
        levels += d.levels
    times.sort()
    n = len(drafts)
    return times[n // 2] * 1e3, sum(times) / n * 1e3, reads / n, levels / n, n


loaded = load_model("smollm2-135m-instruct", "cpu", "float32")
V = loaded.model.config.vocab_size
prompt = encode(loaded.tokenizer, "Write a Python function that checks whether a string is a palindrome, and explain it.")
gpu = PruneSchedule.default("cuda")  # checkpoints 0:0.35,1:0.25,5:0.15 and floor 0.02
head_dir = write_head(Path(tempfile.mkdtemp()) / "h", loaded.model, hidden=576, heads=9, kv_heads=3, head_dim=64,
                      inter=1536, draft_vocab=16000, seed=0)
head = load_head(str(head_dir), loaded.model)
head.w["lm_head.weight"] = head.w["lm_head.weight"] * 40  # peaked, so that drafts grow deep (a flat head stops at once)
for name, prune in (("dense", None), ("pruned", gpu)):
    kw = dict(depth=7, top_k=8, prune=prune)
    for kind, make, convert, tokens in (
        ("draft model", lambda: DraftModelDrafter(loaded.model, V, **kw), lambda ids: ids, 120),
        ("eagle3 head", lambda: Eagle3Drafter(head, loaded.model, **kw), head.to_target, 60),
    ):
        drafts = record(loaded, make(), prompt, tokens)
        for narrow in (0, 64):
            med, mean, reads, levels, n = replay(drafts, convert, narrow, **kw)
            print(f"{kind}, {name:6s}, {'full vocabulary' if not narrow else 'top-64 columns'}: {n:3d} drafts, "
                  f"host ms/draft median {med:5.2f} mean {mean:5.2f}, levels/draft {levels:.2f}, "
                  f"reads/draft {reads:.2f}", flush=True)
