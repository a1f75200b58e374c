"""The benchmark runner behind ``graft bench``: every method on the same prompts, interleaved, Spec-Bench style.

Protocol (Spec-Bench's): greedy, batch 1, the chat template, multi-turn questions run turn by turn with each
method's own answer put back into its conversation; a question's speed is its new tokens over its wall time,
a method's speed the mean of those, and its speedup that mean over plain decoding's (``ar``). Every method's
tokens must equal ``ar``'s: a mismatch is recorded with its question id and fails the run.

Fairness: one process, each model loaded once, a warm-up per method, and the methods interleaved question by
question (the order rotates from one question to the next) so that machine drift hits all of them alike.
Each finished (question, method) is appended to ``runs.jsonl`` at once, so an interrupted run can resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any, Callable, Iterable, Protocol, Sequence

from graft_cli.errors import GraftError
from graft_cli.lossless import MarginTarget, check_lossless, describe, report  # noqa: F401 (check_lossless: API)

REPO_ROOT = Path(__file__).resolve().parents[1]
DATASETS = {"spec-bench": "spec_bench_question.jsonl", "mt-bench": "mt_bench_question.jsonl"}
PEERS = ("hf", "hf-pld", "hf-assisted")
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
HF_PLD_TOKENS = 10
RESULTS_SCHEMA = 1
WARMUP_PROMPT = "Write three short sentences about the sea."
WARMUP_TOKENS = 16


# --- datasets --------------------------------------------------------------------------------------------------
@dataclass
class Question:
    question_id: Any
    category: str
    turns: list[str]


def data_dirs() -> list[Path]:
    """Where the named datasets are looked for: $GRAFT_BENCH_DATA, then the shared data next to the repository."""
    dirs = []
    if os.environ.get("GRAFT_BENCH_DATA"):
        dirs.append(Path(os.environ["GRAFT_BENCH_DATA"]).expanduser())
    dirs += [REPO_ROOT.parent / "shared" / "data" / "bench", REPO_ROOT / "shared" / "data" / "bench"]
    return dirs


def resolve_dataset(spec: str) -> Path:
    """``spec-bench``, ``mt-bench`` or a path to a JSONL file."""
    if spec in DATASETS:
        for d in data_dirs():
            if (d / DATASETS[spec]).is_file():
                return d / DATASETS[spec]
        looked = ", ".join(str(d) for d in data_dirs())
        raise GraftError(f"dataset '{spec}' ({DATASETS[spec]}) not found in {looked} (set GRAFT_BENCH_DATA)")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise GraftError(f"dataset not found: {spec} (use spec-bench, mt-bench or a JSONL file)")
    return path


def parse_questions(lines: Iterable[str], source: str = "dataset") -> list[Question]:
    """Records with ``turns`` (a list of user messages) or ``prompt`` (one), ``question_id`` or ``id``
    (default: the line number) and ``category`` (default: ``all``)."""
    out, seen = [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise GraftError(f"{source} line {number}: invalid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise GraftError(f"{source} line {number}: expected a JSON object")
        turns = record.get("turns")
        if turns is None and isinstance(record.get("prompt"), str):
            turns = [record["prompt"]]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise GraftError(f'{source} line {number}: expected "turns" (non-empty texts) or "prompt" (a text)')
        qid = record.get("question_id", record.get("id", number))
        if qid in seen:
            raise GraftError(f"{source} line {number}: duplicate question id {qid!r}")
        seen.add(qid)
        out.append(Question(qid, str(record.get("category") or "all"), list(turns)))
    return out


def load_questions(path: Path, categories: Sequence[str] | None = None, limit: int | None = None) -> list[Question]:
    """The questions of ``path`` in file order, only ``categories`` (if given), the first ``limit`` of each."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GraftError(f"cannot read {path}: {e}") from None
    questions = parse_questions(text.splitlines(), str(path))
    if categories:
        known = {q.category for q in questions}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise GraftError(f"no questions of category {', '.join(unknown)} in {path} (has: {', '.join(sorted(known))})")
        questions = [q for q in questions if q.category in set(categories)]
    if limit is not None:
        taken: Counter = Counter()
        kept = []
        for q in questions:
            if taken[q.category] < limit:
                taken[q.category] += 1
                kept.append(q)
        questions = kept
    if not questions:
        raise GraftError(f"no questions to run from {path}")
    return questions


def categories_of(questions: Sequence[Question]) -> list[str]:
    return list(dict.fromkeys(q.category for q in questions))


# --- methods ---------------------------------------------------------------------------------------------------
@dataclass
class Turn:
    """One generation: the tokens (a stop token included when one ended it) and what it cost."""

    tokens: list[int]
    wall: float
    accept_lengths: list[int]
    steps: int = 0
    proposed: dict = field(default_factory=dict)
    accepted: dict = field(default_factory=dict)
    time_s: dict = field(default_factory=dict)
    peak_mem_mb: float | None = None
    budget_mean: float | None = None  # mean tree nodes chosen per step under --budget auto
    draft_forwards: int = 0  # forwards of the draft model or head
    margins: list[float] | None = None  # plain decoding: each token's top-2 logit margin (graft_cli/lossless.py)


class Runner(Protocol):
    name: str

    def run(self, ids: list[int], max_new_tokens: int) -> Turn: ...


@dataclass
class MethodSpec:
    """One column of the benchmark: an engine method at a budget, or a transformers peer."""

    name: str  # what tables and files call it, e.g. pld or pld@8
    method: str  # ar, pld, ... or hf, hf-pld, hf-assisted
    kind: str  # "engine" or "peer"
    budget: Any = None  # int, "auto" or None (the device default)
    opts: dict[str, str] = field(default_factory=dict)  # a variant's own MethodConfig settings (--variant)

    def as_dict(self) -> dict:
        spec = {"name": self.name, "method": self.method, "kind": self.kind, "budget": self.budget}
        return spec | ({"opts": self.opts} if self.opts else {})


@dataclass(frozen=True)
class Variant:
    """A named engine method with settings of its own (``--variant deep=graft depth=14``), so that one run
    compares, say, dense at its best depth with graft at its own."""

    method: str
    opts: dict[str, str]


def plan_methods(names: Sequence[str], engine_methods: Sequence[str], budgets: Sequence[Any],
                 variants: dict[str, Variant] | None = None) -> list[MethodSpec]:
    """The benchmark's columns: ``ar`` first (always: it is the baseline), then the asked methods, engine
    methods and variants once per budget when several budgets are given (named ``method@budget``)."""
    variants = variants or {}
    for name, variant in variants.items():
        if name in engine_methods or name in PEERS:
            raise GraftError(f"--variant {name}: the name of a method; call the variant something else")
        if variant.method not in engine_methods or variant.method == "ar":
            raise GraftError(f"--variant {name}: '{variant.method}' is not an engine method other than ar")
    unknown = [n for n in names if n not in engine_methods and n not in PEERS and n not in variants]
    if unknown:
        choices = ", ".join([*engine_methods, *PEERS, *variants])
        raise GraftError(f"unknown method {', '.join(unknown)} (choose from {choices}, or all)")
    names = ["ar", *[n for n in dict.fromkeys(names) if n != "ar"]]
    budgets = list(budgets) or [None]
    specs = []
    for n in names:
        if n in PEERS:
            specs.append(MethodSpec(n, n, "peer"))
        elif n == "ar":
            specs.append(MethodSpec("ar", "ar", "engine"))
        else:
            variant = variants.get(n, Variant(n, {}))
            for b in budgets:
                specs.append(MethodSpec(n if len(budgets) == 1 else f"{n}@{b}", variant.method, "engine", b,
                                        dict(variant.opts)))
    return specs


class MemoryPeak:
    """Peak memory of one generation: the process's resident set on a CPU (Linux resets its high-water mark
    through /proc/self/clear_refs; elsewhere the process-wide peak is reported), allocated memory on CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.peak: float | None = None

    def __enter__(self) -> MemoryPeak:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            self.peak = torch.cuda.max_memory_allocated() / 2**20
            return
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self.peak = int(line.split()[1]) / 1024
                        return
        except OSError:
            pass
        try:
            import resource

            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform != "darwin" else 2**20)
        except (ImportError, OSError):
            self.peak = None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class EngineRunner:
    """An engine method: ``decode`` with the method's proposer, reused across prompts (its retrievers and
    calibration stay warm, as in a ``graft generate --jsonl`` session)."""

    def __init__(self, name: str, target, proposer, stop: set[int], device: str) -> None:
        self.name, self.target, self.proposer, self.stop, self.device = name, target, proposer, stop, device

    def run(self, ids: list[int], max_new_tokens: int) -> Turn:
        from graft_cli.engine import decode
        from graft_cli.sampling import Sampling
        from graft_cli.stats import Stats

        stats = Stats()
        with MemoryPeak(self.device) as mem:
            t0 = perf_counter()
            tokens = [t for step in decode(self.target, self.proposer, ids, Sampling(), max_new_tokens, self.stop,
                                           None, stats) for t in step]
            _sync(self.device)
            wall = perf_counter() - t0
        budgets = getattr(stats, "budgets", None)
        return Turn(
            tokens, wall, list(stats.accept_lengths), stats.steps, dict(stats.proposed), dict(stats.accepted),
            {k: round(v, 4) for k, v in stats.times.items()}, mem.peak,
            round(sum(budgets) / len(budgets), 2) if budgets else None, stats.draft_forwards,
            self.target.margins() if isinstance(self.target, MarginTarget) else None,
        )


    def close(self) -> None:
        close = getattr(self.proposer, "close", None)
        if callable(close):
            close()


class _StepCounter:
    """A generate() streamer that only counts the tokens of each step (the first put is the prompt)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.lengths.append(int(value.numel()))

    def end(self) -> None:
        pass


class PeerRunner:
    """``model.generate(do_sample=False)`` with extra arguments: prompt lookup or an assistant model."""

    def __init__(self, name: str, model, stop: set[int], device: str, **kwargs) -> None:
        self.name, self.model, self.stop, self.device, self.kwargs = name, model, stop, device, kwargs
        self.pad = sorted(stop)[0] if stop else 0

    def run(self, ids: list[int], max_new_tokens: int) -> Turn:
        import torch

        x = torch.tensor([ids], device=self.device)
        streamer = _StepCounter()
        with MemoryPeak(self.device) as mem, torch.inference_mode():
            t0 = perf_counter()
            out = self.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=sorted(self.stop) or None,
                pad_token_id=self.pad,
                streamer=streamer,
                **self.kwargs,
            )
            _sync(self.device)
            wall = perf_counter() - t0
        tokens = out[0, len(ids) :].tolist()
        for i, t in enumerate(tokens):
            if t in self.stop:
                tokens = tokens[: i + 1]
                break
        lengths = streamer.lengths
        # the engine's first token comes from the prefill and is not a verification step; generate's plain loop
        # streams it as a step of its own, so drop it there for a comparable tau
        if not self.kwargs and lengths:
            lengths = lengths[1:]
        return Turn(tokens, wall, lengths, len(lengths), peak_mem_mb=mem.peak)


# --- the run ---------------------------------------------------------------------------------------------------
class Conversation:
    """Prompt formatting and answer text for multi-turn questions (Spec-Bench puts each answer back); ``fit``
    checks (or, with --truncate, cuts) every prompt against the model's limits (graft_cli/limits.py)."""

    def __init__(self, tokenizer, stop: set[int], fit: Callable[[list[int]], list[int]] | None = None) -> None:
        self.tokenizer, self.stop, self.fit = tokenizer, stop, fit

    def encode(self, messages: list[dict]) -> list[int]:
        from graft_cli.loading import encode

        ids = encode(self.tokenizer, messages)
        return self.fit(ids) if self.fit is not None else ids

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.stop], skip_special_tokens=True).strip()


def run_question(runner: Runner, question: Question, conv: Conversation, max_new_tokens: int) -> dict:
    """Every turn of ``question`` with ``runner``; returns its record (texts, tokens and figures per turn)."""
    messages: list[dict] = []
    turns = []
    for text in question.turns:
        messages.append({"role": "user", "content": text})
        ids = conv.encode(messages)
        cpu = time.process_time()
        turn = runner.run(ids, max_new_tokens)
        cpu = time.process_time() - cpu  # every thread of the process: about wall x threads on a quiet machine
        answer = conv.text(turn.tokens)
        messages.append({"role": "assistant", "content": answer})
        turns.append({
            "prompt_tokens": len(ids),
            "new_tokens": len(turn.tokens),
            "wall_s": round(turn.wall, 4),
            "cpu_s": round(cpu, 4),
            "tokens_per_s": round(len(turn.tokens) / turn.wall, 3) if turn.wall else 0.0,
            "tau": round(sum(turn.accept_lengths) / len(turn.accept_lengths), 4) if turn.accept_lengths else 1.0,
            "steps": turn.steps,
            "accept_lengths": turn.accept_lengths,
            "proposed": turn.proposed,
            "accepted": turn.accepted,
            "time_s": turn.time_s,
            "peak_mem_mb": round(turn.peak_mem_mb, 1) if turn.peak_mem_mb is not None else None,
            "budget_mean": turn.budget_mean,
            "draft_forwards": turn.draft_forwards,
            **({"margins": turn.margins} if turn.margins is not None else {}),
            "text": answer,
            "tokens": turn.tokens,
        })
    return {"question_id": question.question_id, "category": question.category, "method": runner.name,
            "turns": turns}


def interleave(questions: Sequence[Question], runners: Sequence[Runner]) -> Iterable[tuple[Question, Runner]]:
    """Question by question, every method; the methods' order rotates by one from a question to the next."""
    n = len(runners)
    for i, q in enumerate(questions):
        for j in range(n):
            yield q, runners[(i + j) % n]


def record_key(record: dict) -> tuple[str, str]:
    return json.dumps(record["question_id"]), record["method"]


def runs_files(out_dir: Path, shard: tuple[int, int] | None = None) -> list[Path]:
    """Where runs are appended: ``runs.jsonl``, or ``runs.K-of-N.jsonl`` for a shard. With ``shard`` None: every
    runs file in ``out_dir`` (what --resume and --report-only merge), ``runs.jsonl`` first."""
    if shard is not None:
        return [out_dir / f"runs.{shard[0]}-of-{shard[1]}.jsonl"]
    return [out_dir / "runs.jsonl"] + sorted(out_dir.glob("runs.*-of-*.jsonl"))


def read_runs(paths: Path | Sequence[Path], fingerprints: dict[str, str]) -> dict[tuple[str, str], dict]:
    """Records of earlier runs whose method fingerprint still matches (what --resume keeps); a later line or file
    replaces an earlier record of the same (question, method)."""
    done: dict[tuple[str, str], dict] = {}
    for path in [paths] if isinstance(paths, Path) else paths:
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interruption
            if isinstance(record, dict) and fingerprints.get(record.get("method")) == record.get("fingerprint"):
                done[record_key(record)] = record
    return done


def execute(
    questions: Sequence[Question],
    runners: Sequence[Runner],
    conv: Conversation,
    max_new_tokens: int,
    runs_path: Path | None = None,
    done: dict | None = None,
    fingerprints: dict[str, str] | None = None,
    on_record: Callable[[dict], None] | None = None,
    stamp: dict | None = None,
    failed: dict[str, str] | None = None,
) -> list[dict]:
    """Run what is not ``done`` yet, interleaved; append each record to ``runs_path`` as soon as it finishes.

    A method that raises is dropped from the rest of the run (its error goes into ``failed``) and the others go
    on; its finished questions stay in ``runs_path`` for a later ``--resume``."""
    import traceback

    failed = failed if failed is not None else {}
    done = dict(done or {})
    out = None
    if runs_path is not None:
        runs_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(runs_path, "a", encoding="utf-8")
        if out.tell() and not runs_path.read_bytes().endswith(b"\n"):  # a line cut short by an interruption
            out.write("\n")
    try:
        for question, runner in interleave(questions, runners):
            key = (json.dumps(question.question_id), runner.name)
            if key in done or runner.name in failed:
                continue
            try:
                record = run_question(runner, question, conv, max_new_tokens)
            except Exception as e:  # noqa: BLE001 - one broken method must not lose hours of the others' runs
                where = traceback.extract_tb(e.__traceback__)[-1]
                failed[runner.name] = (f"question {question.question_id}: {type(e).__name__}: {e} "
                                       f"({Path(where.filename).name}:{where.lineno})")
                continue
            if fingerprints:
                record["fingerprint"] = fingerprints.get(runner.name)
            record.update(stamp or {}, tstamp=round(time.time(), 3))
            done[key] = record
            if out:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
            if on_record:
                on_record(record)
    finally:
        if out:
            out.close()
    wanted = {json.dumps(q.question_id) for q in questions}
    names = {r.name for r in runners} - set(failed)
    return [r for k, r in done.items() if k[0] in wanted and k[1] in names]


def warm_up(runners: Sequence[Runner], conv: Conversation) -> None:
    ids = conv.encode([{"role": "user", "content": WARMUP_PROMPT}])
    for runner in runners:
        runner.run(ids, WARMUP_TOKENS)


# --- figures ---------------------------------------------------------------------------------------------------
def _aggregate(records: Sequence[dict]) -> dict:
    """One method's figures over some questions (Spec-Bench: speed per question, then the mean)."""
    import numpy as np

    speeds, lengths, walls = [], [], []
    tokens = 0
    proposed: Counter = Counter()
    accepted: Counter = Counter()
    times: Counter = Counter()
    steps, peak, cpu, draft_forwards = 0, 0.0, 0.0, 0
    budgets = []
    for r in records:
        q_tokens = sum(t["new_tokens"] for t in r["turns"])
        q_wall = sum(t["wall_s"] for t in r["turns"])
        tokens += q_tokens
        walls.append(q_wall)
        speeds.append(q_tokens / q_wall if q_wall else 0.0)
        for t in r["turns"]:
            lengths += t["accept_lengths"]
            steps += t["steps"]
            proposed.update(t["proposed"])
            accepted.update(t["accepted"])
            times.update(t["time_s"])
            peak = max(peak, t["peak_mem_mb"] or 0.0)
            cpu += t.get("cpu_s", 0.0)
            draft_forwards += t.get("draft_forwards", 0)
            if t.get("budget_mean") is not None:
                budgets.append((t["budget_mean"], t["steps"]))
    total_proposed = sum(proposed.values())
    out = {
        "questions": len(records),
        "turns": sum(len(r["turns"]) for r in records),
        "new_tokens": tokens,
        "wall_s": round(sum(walls), 3),
        "wall_s_per_question": round(float(np.mean(walls)), 3) if walls else 0.0,
        "tokens_per_s": round(float(np.mean(speeds)), 3) if speeds else 0.0,
        "tau": round(sum(lengths) / len(lengths), 3) if lengths else 1.0,
        "steps": steps,
        "nodes_per_step": round(total_proposed / steps, 2) if steps and total_proposed else 0.0,
        "draft_forwards": draft_forwards,
        "draft_forwards_per_step": round(draft_forwards / steps, 2) if steps else 0.0,
        "proposed": dict(proposed),
        "accepted": dict(accepted),
        "time_s": {k: round(v, 3) for k, v in times.items()},
        "peak_mem_mb": round(peak, 1) if peak else None,
        # CPU seconds of the process per wall second: near the thread count on a quiet machine, lower when other
        # work took the cores (a run to distrust)
        "cpu_per_wall": round(cpu / sum(walls), 2) if cpu and sum(walls) else None,
    }
    if budgets:
        n = sum(s for _, s in budgets)
        out["budget_mean"] = round(sum(b * s for b, s in budgets) / n, 2) if n else None
    return out


def summarize(records: Sequence[dict], methods: Sequence[str], categories: Sequence[str]) -> dict:
    """Per category (plus ``mt_bench``, MT-Bench's eight categories together, as Spec-Bench reports them) and
    overall, per method: the figures and the speedup over ``ar``. Only questions that every method finished
    count, so that all methods are compared on the same prompts."""
    by_q: dict[str, dict[str, dict]] = {}
    for r in records:
        by_q.setdefault(json.dumps(r["question_id"]), {})[r["method"]] = r
    complete = {q: m for q, m in by_q.items() if all(name in m for name in methods)}
    groups = {c: [m for m in complete.values() if m[methods[0]]["category"] == c] for c in categories}
    groups = {c: g for c, g in groups.items() if g}
    mt = [c for c in groups if c in MT_BENCH]
    if len(mt) > 1 and len(mt) < len(groups):  # Spec-Bench reports MT-Bench's eight categories as one task too
        at = list(groups).index(mt[-1]) + 1
        items = list(groups.items())
        groups = dict([*items[:at], ("mt_bench", [q for c in mt for q in groups[c]]), *items[at:]])
    groups["overall"] = list(complete.values())
    out = {}
    for group, qs in groups.items():
        row = {name: _aggregate([q[name] for q in qs]) for name in methods}
        base = row.get("ar", {}).get("tokens_per_s") or 0.0
        for name in methods:
            row[name]["speedup"] = round(row[name]["tokens_per_s"] / base, 3) if base else None
        out[group] = row
    return out


def fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --- outputs ---------------------------------------------------------------------------------------------------
def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.replace("@", "-b"))


def write_answers(out_dir: Path, records: Sequence[dict], methods: Sequence[str], questions: Sequence[Question],
                  model_id: str) -> list[Path]:
    """One Spec-Bench answer file per method (``model_answer/<model_id>.jsonl`` layout, one line a question)."""
    order = {json.dumps(q.question_id): i for i, q in enumerate(questions)}
    paths = []
    answers = out_dir / "answers"
    answers.mkdir(parents=True, exist_ok=True)
    for name in methods:
        mine = sorted((r for r in records if r["method"] == name), key=lambda r: order.get(json.dumps(r["question_id"]), 0))
        path = answers / f"{safe_name(name)}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for r in mine:
                line = {
                    "question_id": r["question_id"],
                    "category": r["category"],
                    "answer_id": hashlib.sha256(f"{model_id}-{name}-{r['question_id']}".encode()).hexdigest()[:22],
                    "model_id": f"{model_id}-{safe_name(name)}",
                    "choices": [{
                        "index": 0,
                        "turns": [t["text"] for t in r["turns"]],
                        "new_tokens": [t["new_tokens"] for t in r["turns"]],
                        "wall_time": [t["wall_s"] for t in r["turns"]],
                        "accept_lengths": [x for t in r["turns"] for x in (t["accept_lengths"] or [1] * t["new_tokens"])],
                    }],
                    "tstamp": r.get("tstamp", time.time()),
                }
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths


def environment(device: str) -> dict:
    """Package versions and the device, for results.json."""
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for pkg in ("graft-sd", "torch", "transformers", "numpy", "matplotlib", "rich", "typer"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    import torch

    info = {"device": device, "platform": platform.platform(), "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device).index or 0)
    else:
        info["cpu"] = _cpu_name()
    return {"versions": versions, "device": info}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(summary: dict, methods: Sequence[str], title: str):
    """Rich table: categories x methods, each cell the speedup over ar and tau (ar's cell: its tokens/s)."""
    from rich.table import Table

    t = Table(title=title, caption="cell: speedup over ar (Spec-Bench: mean tok/s ratio) and τ (tokens per target "
              "forward); ar: its mean tok/s", caption_justify="left")
    t.add_column("category")
    for name in methods:
        t.add_column(name, justify="right")
    for group, row in summary.items():
        cells = []
        for name in methods:
            m = row[name]
            if name == "ar":
                cells.append(f"{m['tokens_per_s']:.2f} tok/s")
            else:
                sp = f"{m['speedup']:.2f}x" if m["speedup"] is not None else "-"
                cells.append(f"{sp} τ{m['tau']:.2f}")
        t.add_row(group, *cells, end_section=group == list(summary)[-2] if len(summary) > 1 else False,
                  style="bold" if group == "overall" else None)
    return t


def lossless_line(lossless: dict) -> str:
    """Under the table: how many runs differed from ar, as floating-point ties (each with its margin) and as
    mismatches."""
    ties = ", ".join(f"{d['method']} q{d['question_id']} turn {d['turn']} token {d['position']} margin "
                     f"{d['ar_margin']:.4g}" for d in lossless["ties"])
    return (f"lossless: {len(lossless['mismatches'])} mismatches, {len(lossless['ties'])} floating-point ties (ar's "
            f"top-2 logit margin <= {lossless['tie_tolerance']:g} in {lossless['dtype']})" + (f": {ties}" if ties else ""))


# --- the whole command -----------------------------------------------------------------------------------------
@dataclass
class BenchOptions:
    model: str
    draft: str | None = None
    dataset: str = "spec-bench"
    categories: list[str] | None = None
    limit: int | None = None
    max_new_tokens: int = 128
    methods: list[str] = field(default_factory=lambda: ["all"])
    budgets: list[Any] = field(default_factory=list)  # ints and/or "auto"; empty: the device default
    options: dict[str, str] = field(default_factory=dict)  # retriever options (datastore=...)
    method_opts: dict[str, str] = field(default_factory=dict)  # other MethodConfig fields, e.g. depth=4, chain=true
    variants: dict[str, Variant] = field(default_factory=dict)  # named methods with settings of their own
    device: str = "auto"
    dtype: str = "auto"
    out: Path = Path("bench-results")
    resume: bool = False
    report_only: bool = False  # write the outputs from OUT/runs*.jsonl, run nothing
    shard: tuple[int, int] | None = None  # (K, N): questions K, K+N, ... only; records to OUT/runs.K-of-N.jsonl
    warmup: bool = True
    plots: bool = True
    command: str = ""
    device_map: str | dict | None = None  # accelerate's placement of a model larger than one GPU (--device-map)
    truncate: str | None = None  # left or right: cut prompts that would reach past the model's limits


def _git_commit() -> str | None:
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _expand_methods(names: Sequence[str], engine_methods: Sequence[str], draft: str | None) -> tuple[list[str], bool]:
    """``all`` means every engine method and every peer that can run; returns (names, explicit)."""
    if list(names) == ["all"]:
        peers = [p for p in PEERS if p != "hf-assisted" or draft]
        return [*engine_methods, *peers], False
    return list(names), True


def method_config(spec: MethodSpec, options: dict, draft: str | None, method_opts: dict | None = None):
    """The MethodConfig of an engine method: its budget, the retriever options, ``--draft`` where the method takes
    one, and any other MethodConfig field given as text (``--method-opt depth=4``, then the variant's own),
    converted to the field's type."""
    import dataclasses
    import typing

    from graft_cli import methods

    config = methods.MethodConfig(method=spec.method, budget=spec.budget, options=dict(options),
                                  draft=draft if uses_draft(spec) else None)
    if spec.method == "ar":
        return config
    hints = typing.get_type_hints(methods.MethodConfig)
    fields = {f.name for f in dataclasses.fields(methods.MethodConfig)} - {"method", "budget", "options", "draft"}
    for key, text in ((method_opts or {}) | spec.opts).items():
        if key not in fields:
            raise GraftError(f"--method-opt {key}: not a method setting (choose from {', '.join(sorted(fields))})")
        setattr(config, key, _convert(text, hints.get(key), key))
    return config


def _convert(text: str, hint, key: str):
    import typing

    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if text.lower() in ("none", "") and type(None) in typing.get_args(hint):
        return None
    for kind in kinds:
        if typing.get_origin(kind) is list:
            return [part.strip() for part in text.split(",") if part.strip()]
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            continue
        if kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                continue
        if kind is str:
            return text
    raise GraftError(f"--method-opt {key}: cannot read '{text}' as {hint}")


def uses_draft(spec: MethodSpec) -> bool:
    """Whether a method takes ``--draft``: hf-assisted, and the engine methods ``methods.TAKES_DRAFT`` names
    (every engine method but ar where the module does not say)."""
    from graft_cli import methods

    if spec.kind == "peer":
        return spec.method == "hf-assisted"
    takes = getattr(methods, "TAKES_DRAFT", None)
    return spec.method != "ar" and (takes is None or spec.method in takes)


def build_runners(specs, loaded, draft_loaded, options, explicit: bool, warn: Callable[[str], None],
                  method_opts: dict | None = None, draft_spec: str | None = None):
    """A runner per method spec; with ``all``, engine methods that cannot be built here (a datastore or a draft
    model missing) are left out with a warning instead of failing the run."""
    from graft_cli import methods
    from graft_cli.loading import stop_ids
    from graft_cli.target import Target

    stop = stop_ids(loaded)
    device = loaded.device
    target = Target(loaded.model)
    runners, kept = [], []
    for spec in specs:
        if spec.kind == "peer":
            kwargs: dict = {}
            if spec.method == "hf-pld":
                kwargs["prompt_lookup_num_tokens"] = HF_PLD_TOKENS
            elif spec.method == "hf-assisted":
                if draft_loaded is None:
                    raise GraftError("hf-assisted needs a draft model: give --draft MODEL")
                kwargs["assistant_model"] = draft_loaded.model
            runners.append(PeerRunner(spec.name, loaded.model, stop, device, **kwargs))
        else:
            config = method_config(spec, options, draft_loaded.spec if draft_loaded else draft_spec, method_opts)
            try:
                proposer = methods.build(config, loaded)
            except GraftError as e:
                if explicit or spec.method == "ar":
                    raise GraftError(f"method {spec.name}: {e}") from e
                warn(f"skipping {spec.name}: {e}")
                continue
            # plain decoding records its margins: what tells a floating-point tie from a real difference
            runner_target = MarginTarget(loaded.model) if spec.method == "ar" else target
            runners.append(EngineRunner(spec.name, runner_target, proposer, stop, device))
        kept.append(spec)
    return runners, kept


class shared_models:
    """While active, ``graft_cli.loading.load_model`` returns the already loaded model for the same (spec, device,
    dtype): drafter methods that load their ``--draft`` themselves share the one copy hf-assisted uses, so every
    model is loaded once however many methods and budgets run. (Drafters do not modify the model: they keep
    their own caches.)"""

    def __init__(self, *loaded) -> None:
        self.cache = {}
        for item in loaded:
            if item is not None:
                self.add(item)

    def add(self, item) -> None:
        dtype = str(next(item.model.parameters()).dtype).replace("torch.", "")
        for device in (item.device, item.device.split(":")[0], "auto"):
            for d in (dtype, "auto"):
                self.cache.setdefault((str(item.spec), device, d), item)

    def __enter__(self) -> shared_models:
        from graft_cli import loading

        self.original = loading.load_model

        def load_model(spec, device="auto", dtype="auto", device_map=None):
            if device_map is not None:  # a sharded model is the bench's own target, loaded once
                return self.original(spec, device, dtype, device_map)
            key = (str(spec), str(device), str(dtype))
            if key not in self.cache:
                item = self.original(spec, device, dtype)
                self.add(item)
                self.cache[key] = item
            return self.cache[key]

        loading.load_model = load_model
        return self

    def __exit__(self, *exc) -> None:
        from graft_cli import loading

        loading.load_model = self.original


def run_bench(opts: BenchOptions, console=None, err_console=None) -> int:
    """The whole ``graft bench``: returns the exit code (1 when a method was not lossless)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from graft_cli import methods
    from graft_cli.catalog import model_checksum
    from graft_cli.loading import load_model, stop_ids

    console = console or Console(width=None if sys.stdout.isatty() else 200)
    err = err_console or Console(stderr=True)
    started = time.time()
    path = resolve_dataset(opts.dataset)
    questions = load_questions(path, opts.categories, opts.limit)
    categories = categories_of(questions)
    if opts.shard:
        if opts.report_only:
            raise GraftError("--report-only merges every shard: give it without --shard")
        questions = questions[opts.shard[0]::opts.shard[1]]
        if not questions:
            raise GraftError(f"--shard {opts.shard[0]}/{opts.shard[1]}: no questions in this shard")
    names, explicit = _expand_methods(opts.methods, methods.METHODS, opts.draft)
    specs = plan_methods(names, methods.METHODS, opts.budgets, opts.variants)
    if any(s.method == "hf-assisted" for s in specs) and not opts.draft:
        raise GraftError("hf-assisted needs a draft model: give --draft MODEL")

    err.print(f"graft bench: {len(questions)} questions ({', '.join(categories)}) from {path}")
    loaded = load_model(opts.model, opts.device, opts.dtype, opts.device_map)
    device = loaded.device
    # a sharded target's draft sits whole where the target's inputs go; a head is loaded by the drafter itself
    head = bool(opts.draft) and opts.draft.startswith("eagle3:")
    draft_device = device if opts.device_map else opts.device
    draft_loaded = load_model(opts.draft, draft_device, opts.dtype) if opts.draft and not head else None
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    with shared_models(loaded, draft_loaded):
        runners, specs = build_runners(specs, loaded, draft_loaded, opts.options, explicit,
                                       lambda m: err.print(f"graft: {m}"), opts.method_opts, opts.draft)
    names = [s.name for s in specs]
    stop = stop_ids(loaded)
    depth = max(reach_depth(s, opts, draft_loaded, device) for s in specs)
    limits = loaded.limits
    conv = Conversation(loaded.tokenizer, stop, lambda ids: limits.fit(ids, opts.max_new_tokens, depth, opts.truncate))
    if opts.truncate is None:
        check_reach(questions, Conversation(loaded.tokenizer, stop), limits, opts.max_new_tokens, depth)

    checksum = model_checksum(loaded.path)
    draft_checksum = model_checksum(draft_loaded.path) if draft_loaded else None
    if head:
        from graft_cli.heads import resolve_head

        draft_checksum = _file_sha256(resolve_head(opts.draft[len("eagle3:"):]) / "model.safetensors")
    data_sha = _file_sha256(path)
    commit = _git_commit()
    env = environment(device)
    common = {"model": checksum, "dataset": data_sha, "max_new_tokens": opts.max_new_tokens, "device": device,
              "dtype": dtype, "threads": env["device"]["torch_threads"]}
    if opts.truncate:  # cut prompts are other prompts
        common["truncate"] = opts.truncate
    fingerprints = {}
    for s in specs:
        parts = dict(common, spec=s.as_dict())
        if uses_draft(s):
            parts.update(draft=draft_checksum)
        if s.kind == "engine" and s.method != "ar":
            parts.update(options=opts.options)
            if opts.method_opts:
                parts.update(method_opts=opts.method_opts)
        fingerprints[s.name] = fingerprint(parts)

    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_path = runs_files(out_dir, opts.shard)[0]
    every_run = runs_files(out_dir)
    resume = opts.resume or opts.report_only
    if opts.report_only and not any(p.is_file() for p in every_run):
        raise GraftError(f"--report-only: no {every_run[0]} to report from")
    done = read_runs(every_run, fingerprints) if resume else {}
    if not resume:
        for p in [runs_path] if opts.shard else every_run:
            p.unlink(missing_ok=True)
    wanted = {json.dumps(q.question_id) for q in questions}
    done = {k: r for k, r in done.items() if k[0] in wanted}
    old = {r.get("commit") for r in done.values()} - {commit}
    if done:
        err.print(f"graft bench: resuming: {len(done)} of {len(questions) * len(runners)} runs already done")
        if old:
            err.print(f"graft: warning: resumed runs come from other code versions ({', '.join(map(str, old))})")
    todo = [r for r in runners if any((json.dumps(q.question_id), r.name) not in done for q in questions)]
    if opts.report_only:
        todo = []
    if opts.warmup and todo:
        err.print(f"graft bench: warming up {len(todo)} methods")
        warm_up(todo, conv)

    total = len(questions) * len(runners)
    failed: dict[str, str] = {}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=err, transient=False)

    def on_record(record: dict) -> None:
        wall = sum(t["wall_s"] for t in record["turns"])
        toks = sum(t["new_tokens"] for t in record["turns"])
        taus = [x for t in record["turns"] for x in t["accept_lengths"]]
        cpu = sum(t.get("cpu_s", 0.0) for t in record["turns"])
        progress.console.print(
            f"  {record['question_id']!s:>5} {record['category']:<15} {record['method']:<14} {toks:>5} tok "
            f"{wall:7.2f} s {toks / wall if wall else 0:7.2f} tok/s  τ {sum(taus) / len(taus) if taus else 1:.2f}"
            f"  cpu/wall {cpu / wall if wall else 0:.1f}",
            highlight=False,
        )
        progress.advance(task)

    t_run = perf_counter()
    interrupted = None
    with progress:
        task = progress.add_task("bench", total=total, completed=len(done))
        try:
            if opts.report_only:
                records = [r for r in done.values() if r["method"] in names]
            else:
                records = execute(questions, runners, conv, opts.max_new_tokens, runs_path, done, fingerprints,
                                  on_record, {"commit": commit}, failed)
        except KeyboardInterrupt as e:
            interrupted = e
            records = [r for k, r in read_runs(every_run, fingerprints).items() if k[0] in wanted and k[1] in names]
        finally:
            for runner in runners:  # retrievers that keep state on disk (when asked to) save it
                close = getattr(runner, "close", None)
                if callable(close):
                    close()
    run_s = perf_counter() - t_run
    for name, error in failed.items():
        err.print(f"graft: error: method {name} failed and was dropped: {error}", highlight=False)
    names = [n for n in names if n not in failed]
    records = [r for r in records if r["method"] in names]

    summary = summarize(records, names, categories)
    lossless = report(records, dtype)
    mismatches = lossless["mismatches"]
    model_id = Path(str(opts.model)).name
    config = {
        "command": opts.command,
        "argv": sys.argv,
        "model": {"spec": opts.model, "path": str(loaded.path), "checksum": checksum},
        "draft": {"spec": opts.draft, "path": str(draft_loaded.path), "checksum": draft_checksum} if draft_loaded else None,
        "dataset": {"spec": opts.dataset, "path": str(path), "sha256": data_sha},
        "categories": categories,
        "limit": opts.limit,
        "questions": len(questions),
        "max_new_tokens": opts.max_new_tokens,
        "methods": [s.as_dict() for s in specs],
        "budgets": opts.budgets,
        "default_budget": methods.default_budget(device),
        "options": opts.options,
        "method_opts": opts.method_opts,
        "variants": {name: {"method": v.method, **v.opts} for name, v in opts.variants.items()},
        "dtype": dtype,
        "device_map": opts.device_map,
        "truncate": opts.truncate,
        "sampling": "greedy",
        "warmup": opts.warmup,
        "interleaving": "question by question, method order rotating by one per question",
        "commit": commit,
        **env,
    }
    n_done = sum(len(r["turns"]) for r in records)
    timing = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "total_s": round(time.time() - started, 1),
        "run_s": round(run_s, 1),
        "turns": n_done,
        "method_s_per_question": _per_question_seconds(records, names),
        "wall_s_per_question_all_methods": round(
            sum(sum(t["wall_s"] for t in r["turns"]) for r in records) / max(1, len({record_key(r)[0] for r in records})), 2),
    }
    results = {
        "schema": RESULTS_SCHEMA,
        "config": config,
        "summary": summary,
        "lossless": lossless,
        "failed": failed,
        "timing": timing,
        "prompts": [_lean(r) for r in records],
        "complete": interrupted is None and not failed and len(records) == total,
        "report_only": opts.report_only,
    }
    if opts.shard:  # the merged outputs come from --report-only once every shard has finished
        write_results(out_dir / f"results.{opts.shard[0]}-of-{opts.shard[1]}.json", results)
    else:
        write_results(out_dir / "results.json", results)
        write_answers(out_dir, records, names, questions, model_id)
        if opts.plots and summary.get("overall"):
            from graft_cli import plots

            plots.write_all(out_dir, results)
    n_questions = summary.get("overall", {}).get("ar", {}).get("questions", 0)
    title = f"{model_id} on {opts.dataset}: {n_questions} questions, {opts.max_new_tokens} new tokens, {device}"
    console.print(table(summary, names, title))
    console.print(lossless_line(lossless), highlight=False)
    if opts.shard:
        err.print(f"graft bench: shard {opts.shard[0]}/{opts.shard[1]} in {out_dir}/{runs_path.name}; once every "
                  f"shard has finished, the same command with --report-only instead of --shard merges them")
    else:
        err.print(f"graft bench: results in {out_dir}/ (results.json, answers/, runs.jsonl"
                  f"{', plots' if opts.plots else ''})")
    if interrupted is not None:
        raise interrupted
    for d in lossless["ties"]:
        err.print(f"graft: note: {describe(d, lossless['tie_tolerance'])}", highlight=False)
    for d in mismatches:
        err.print(f"graft: error: {describe(d, lossless['tie_tolerance'])}", highlight=False)
    return 1 if mismatches or failed else 0


def reach_depth(spec: MethodSpec, opts: BenchOptions, draft_loaded, device: str) -> int:
    """How far past the prompt and its answer a method's last forward reaches: its deepest tree, or the tokens a
    transformers peer looks ahead."""
    from graft_cli.limits import tree_reach

    if spec.kind == "engine":
        return tree_reach(method_config(spec, opts.options, opts.draft, opts.method_opts), device)
    if spec.method == "hf-assisted" and draft_loaded is not None:
        return int(getattr(draft_loaded.model.generation_config, "num_assistant_tokens", 20) or 20)
    return HF_PLD_TOKENS if spec.method == "hf-pld" else 0


def check_reach(questions: Sequence[Question], conv: Conversation, limits, max_new_tokens: int, depth: int) -> None:
    """Before any forward: every question's last turn, each earlier answer counted at its longest, fits the model
    (a GraftError naming the question otherwise)."""
    for q in questions:
        messages: list[dict] = []
        for text in q.turns:
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
        ids = conv.encode(messages[:-1]) + [0] * (max_new_tokens * (len(q.turns) - 1))
        try:
            limits.fit(ids, max_new_tokens, depth)
        except GraftError as e:
            answers = " (earlier answers counted at --max-new-tokens each)" if len(q.turns) > 1 else ""
            raise GraftError(f"question {q.question_id}{answers}: {e}") from None


def _lean(record: dict) -> dict:
    """A record for results.json: every figure; the texts are in answers/, the token ids in runs.jsonl."""
    out = {k: v for k, v in record.items() if k != "turns"}
    out["turns"] = [{k: v for k, v in t.items() if k not in ("text", "tokens", "margins")} for t in record["turns"]]
    return out


def write_results(path: Path, results: dict) -> None:
    """results.json: indented, except one line per prompt record (a full run has hundreds)."""
    head = {k: v for k, v in results.items() if k != "prompts"}
    text = json.dumps(head, indent=1, ensure_ascii=False)[:-2]  # drop the closing "\n}"
    prompts = ",\n".join("  " + json.dumps(r, ensure_ascii=False) for r in results.get("prompts", []))
    path.write_text(f'{text},\n "prompts": [\n{prompts}\n ]\n}}\n')


def _per_question_seconds(records: Sequence[dict], names: Sequence[str]) -> dict[str, float]:
    """Mean wall seconds per question of each method (every turn): what sizing a longer run needs."""
    out = {}
    for name in names:
        walls = [sum(t["wall_s"] for t in r["turns"]) for r in records if r["method"] == name]
        out[name] = round(sum(walls) / len(walls), 2) if walls else None
    return out
