"""What a benchmark reports: figures per category and method, the table, Spec-Bench answer files and
results.json (the lossless check itself is graft_cli/runtime/lossless.py)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import time
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Sequence

from graft_cli.bench.datasets import MT_BENCH, Question

RESULTS_SCHEMA = 1


def _aggregate(records: Sequence[dict]) -> dict:
    """One method's figures over some questions (Spec-Bench: speed per question, then the mean)."""
    import numpy as np

    speeds, lengths, walls, decode_speeds, firsts = [], [], [], [], []
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
        if all(t.get("first_token_s") is not None for t in r["turns"]):  # decoding alone: after the first tokens
            firsts += [t["first_token_s"] for t in r["turns"]]
            rest = q_wall - sum(t["first_token_s"] for t in r["turns"])
            decode_speeds.append((q_tokens - sum(t["first_tokens"] for t in r["turns"])) / rest if rest > 0 else 0.0)
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
        # time to the first tokens (the prefill, and for a peer its first step), and the speed after it
        "first_token_s": round(float(np.mean(firsts)), 3) if firsts else None,
        "decode_tokens_per_s": round(float(np.mean(decode_speeds)), 3) if len(decode_speeds) == len(records) else None,
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
    passes = _pass_speeds(records)
    if passes is not None:
        out["pass_tokens_per_s"] = passes
    return out


def _pass_speeds(records: Sequence[dict]) -> list[float] | None:
    """With ``--repeats``: the mean tokens/s of every pass on its own (each question's turns at that pass's wall
    times), or None when a record has a single pass or passes that produced different tokens."""
    import numpy as np

    if not records or any(r.get("rounds_agree") is not True for r in records):
        return None
    passes = min(len(t.get("round_wall_s", ())) for r in records for t in r["turns"])
    if passes < 2:
        return None
    out = []
    for k in range(passes):
        speeds = []
        for r in records:  # as the fastest-pass figure: a question's tokens over its turns' wall time
            wall = sum(t["round_wall_s"][k] for t in r["turns"])
            speeds.append(sum(t["new_tokens"] for t in r["turns"]) / wall if wall else 0.0)
        out.append(round(float(np.mean(speeds)), 3))
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
        for speed, ratio in (("tokens_per_s", "speedup"), ("decode_tokens_per_s", "decode_speedup")):
            base = row.get("ar", {}).get(speed) or 0.0
            for name in methods:
                mine = row[name][speed]
                row[name][ratio] = round(mine / base, 3) if base and mine is not None else None
        base_passes = row.get("ar", {}).get("pass_tokens_per_s")
        for name in methods:  # each pass's methods ran side by side: their ratios are paired, pass by pass
            mine = row[name].get("pass_tokens_per_s")
            if base_passes and mine and len(mine) == len(base_passes):
                ratios = [m / b if b else 0.0 for m, b in zip(mine, base_passes)]
                row[name]["pass_speedups"] = [round(x, 3) for x in ratios]
                row[name]["pass_speedup_median"] = round(median(ratios), 3)
        out[group] = row
    return out


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


def table(summary: dict, methods: Sequence[str], title: str, decoding: bool = False, passes: bool = False):
    """Rich table: categories x methods, each cell the speedup over ar and tau (ar's cell: its tokens/s).
    ``decoding``: the speeds after the first tokens (the prefill excluded), so the decoding speed-up shows alone;
    ``passes`` (``--repeats``): each pass's speedup on its own, their median and range."""
    from rich.table import Table

    speed, ratio = ("decode_tokens_per_s", "decode_speedup") if decoding else ("tokens_per_s", "speedup")
    what = "decoding alone, after the first tokens: " if decoding else ""
    caption = (f"cell: {what}speedup over ar (Spec-Bench: mean tok/s ratio) and τ (tokens per target forward); ar: "
               "its mean tok/s")
    if passes:
        caption = ("cell: the speedup over ar of each pass on its own (its methods ran side by side), the median "
                   "of the passes \\[lowest-highest]; ar: its median tok/s")  # rich markup: \\[ prints a bracket
    t = Table(title=title, caption=caption, caption_justify="left")
    t.add_column("category")
    for name in methods:
        t.add_column(name, justify="right")
    for group, row in summary.items():
        cells = []
        for name in methods:
            m = row[name]
            if passes:
                cells.append(_pass_cell(m, name == "ar"))
            elif name == "ar":
                cells.append(f"{m[speed]:.2f} tok/s" if m[speed] is not None else "-")
            else:
                sp = f"{m[ratio]:.2f}x" if m[ratio] is not None else "-"
                cells.append(f"{sp} τ{m['tau']:.2f}")
        t.add_row(group, *cells, end_section=group == list(summary)[-2] if len(summary) > 1 else False,
                  style="bold" if group == "overall" else None)
    return t


def _pass_cell(figures: dict, is_base: bool) -> str:
    if is_base:
        speeds = figures.get("pass_tokens_per_s")
        return f"{median(speeds):.2f} tok/s" if speeds else "-"
    ratios = figures.get("pass_speedups")
    if not ratios:
        return "-"
    return f"{figures['pass_speedup_median']:.2f}x \\[{min(ratios):.2f}-{max(ratios):.2f}]"


def lossless_line(lossless: dict) -> str:
    """Under the table: how many runs differed from ar, as floating-point ties (each with its margin) and as
    mismatches."""
    ties = ", ".join(f"{d['method']} q{d['question_id']} turn {d['turn']} token {d['position']} margin "
                     f"{d['ar_margin']:.4g}" for d in lossless["ties"])
    return (f"lossless: {len(lossless['mismatches'])} mismatches, {len(lossless['ties'])} floating-point ties (ar's "
            f"top-2 logit margin <= {lossless['tie_tolerance']:g} in {lossless['dtype']})" + (f": {ties}" if ties else ""))


def lean_record(record: dict) -> dict:
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


def per_question_seconds(records: Sequence[dict], names: Sequence[str]) -> dict[str, float]:
    """Mean wall seconds per question of each method (every turn): what sizing a longer run needs."""
    out = {}
    for name in names:
        walls = [sum(t["wall_s"] for t in r["turns"]) for r in records if r["method"] == name]
        out[name] = round(sum(walls) / len(walls), 2) if walls else None
    return out
