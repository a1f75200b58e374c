"""``graft heads train``: an EAGLE-3 head for a Llama/Qwen-architecture target, trained online against it.

The recipe (docs/heads.md): the target, without gradients, gives per packed batch its hidden states at three
layers and its next-token distribution over the draft vocabulary; the head runs the training-time test for K
steps, each step feeding its own output back; the loss at step k is the cross-entropy of the head's draft
distribution against the target's (soft targets), weighted ``decay**k``. AdamW, linear warm-up then cosine decay,
gradient clipping. Every batch is a function of (seed, step) and every ``checkpoint_every`` steps the full state
is written atomically, so ``--resume`` continues a killed run exactly where its last checkpoint left it.
``--max-minutes`` bounds a run by wall-clock time instead of a step count (a lent GPU is lent by the minute), and
``--checkpoint-minutes`` checkpoints by wall-clock time too (a call cut off by its time limit keeps a recent head).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from graft_cli.heads.layouts import HeadConfig, layer_indices
from graft_cli.core import GraftError
from graft_cli.heads import checkpoint as ckpt
from graft_cli.heads.data import Batch, Documents, Packer, draft_vocabulary, read_documents, split
from graft_cli.heads.model import TrainableHead, context_mask, shift, step_inputs
from graft_cli.heads.regenerate import Regenerator
from graft_cli.heads.teacher import Lesson, teach
from graft_cli.runtime.cpu_linear import use_cpu_linears
from graft_cli.runtime.loading import load_model, pick_device


@dataclass
class Settings:
    """Everything that defines a run; stored in every checkpoint (a resume keeps them, but for the few
    ``RESUMABLE`` ones it may change)."""

    model: str
    data: list[str]
    run: str
    out: str
    fields: list[str] = field(default_factory=list)
    max_steps: int = 2000
    ttt: int = 7
    step_decay: float = 0.8
    draft_vocab: int = 8192
    seq_len: int = 512
    batch_size: int = 4
    lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    heldout_every: int = 100
    eval_sequences: int = 16
    checkpoint_every: int = 100
    log_every: int = 10
    max_documents: int | None = None
    regenerate: bool = False
    regenerate_tokens: int = 256
    device: str = "auto"
    threads: int | None = None
    max_minutes: float | None = None
    checkpoint_minutes: float | None = None


RESUMABLE = ("max_steps", "checkpoint_every", "log_every", "threads", "device", "out", "max_minutes",
             "checkpoint_minutes")
CALIBRATION_STEPS = 10  # steps timed before a time budget sets the schedule's length
FINISH_SHARE = 0.02  # of a time budget, kept for the last evaluation and checkpoint until one has been timed


class TimeBudget:
    """``--max-minutes``: the run ends cleanly by a wall-clock deadline counted from the start of the command.
    After ``CALIBRATION_STEPS`` steps, and after every step from then on, the schedule's last step (``max_steps``,
    where the cosine reaches 0; never past the given ``--max-steps``) becomes the last one the measured pace fits
    before the deadline less the time of a final evaluation and checkpoint. So the learning rate has decayed when
    time is up, and the run ends with a checkpoint and its held-out figures like any other.

    ``--checkpoint-minutes``: a checkpoint is also :meth:`due` once that much wall time has passed since the last
    one (or the start), whatever the step count."""

    def __init__(self, minutes: float | None, start: float, checkpoint_minutes: float | None = None) -> None:
        if minutes is not None and minutes <= 0:
            raise GraftError(f"--max-minutes must be > 0, got {minutes}")
        if checkpoint_minutes is not None and checkpoint_minutes <= 0:
            raise GraftError(f"--checkpoint-minutes must be > 0, got {checkpoint_minutes}")
        self.seconds = minutes * 60 if minutes else None
        self.deadline = start + self.seconds if self.seconds else None
        self.every = checkpoint_minutes * 60 if checkpoint_minutes else None
        self.finish: float | None = None  # seconds the latest evaluation and checkpoint took
        self.first, self.t0, self.limit, self.saved = 0, start, 0, start

    def begin(self, s: Settings, step: int, now: float) -> None:
        self.first, self.t0, self.limit = step, now, s.max_steps

    def checkpointed(self, seconds: float, now: float) -> None:
        """A checkpoint took ``seconds`` and ended at ``now``."""
        self.finish, self.saved = seconds, now

    def due(self, now: float) -> bool:
        """Whether ``--checkpoint-minutes`` have passed since the last checkpoint."""
        return self.every is not None and now - self.saved >= self.every

    def update(self, s: Settings, done: int, now: float) -> None:
        """Set ``s.max_steps`` from the pace so far (``done`` steps finished at ``now``); ``done`` itself when
        not one more step fits, which makes this step the last."""
        if self.deadline is None:
            return
        reserve = self.finish if self.finish is not None else FINISH_SHARE * self.seconds
        left = self.deadline - now - reserve
        ran = done - self.first
        if ran < CALIBRATION_STEPS and left > 0:
            return
        pace = (now - self.t0) / max(ran, 1)
        s.max_steps = max(done, min(self.limit, done + int(left / pace)))


def lr_at(s: Settings, step: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``max_steps``."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    span = max(s.max_steps - s.warmup, 1)
    return s.lr * 0.5 * (1 + math.cos(math.pi * min(step - s.warmup, span) / span))


def draft_config(target_config: Any, draft_vocab: int) -> HeadConfig:
    """The head's shape: the target's own layer width, heads and MLP (SpecForge's choice for its targets)."""
    t = target_config
    heads = t.num_attention_heads
    rope = getattr(t, "rope_parameters", None) or {}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None
    return HeadConfig(
        hidden=t.hidden_size, heads=heads, kv_heads=getattr(t, "num_key_value_heads", None) or heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads, intermediate=t.intermediate_size,
        vocab=t.vocab_size, draft_vocab=draft_vocab, rope_theta=float(rope.get("rope_theta", 10000.0)),
        eps=float(t.rms_norm_eps), act=t.hidden_act, rope_scaling=scaling,
        layers=layer_indices(t.num_hidden_layers),
    )


def new_head(target: torch.nn.Module, cfg: HeadConfig, draft_ids: torch.Tensor, seed: int) -> TrainableHead:
    """A fresh head; ``lm_head`` starts as the target's output rows of the draft vocabulary and ``norm`` as the
    target's final norm (the head learns to produce what the target's last layer would)."""
    torch.manual_seed(seed)
    embed = target.get_input_embeddings().weight
    head = TrainableHead(cfg, target.config.hidden_size, embed).to(embed.device)
    head.set_vocab(draft_ids)
    with torch.no_grad():
        out = target.get_output_embeddings().weight
        if out.shape[1] == cfg.hidden:
            head.lm_head.weight.copy_(out.index_select(0, draft_ids.to(out.device)).float())
        final = getattr(target.model, "norm", None)
        if final is not None and final.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(final.weight.float())
    return head


@dataclass
class StepResult:
    loss: torch.Tensor  # weighted sum over TTT steps (what is optimised)
    step_losses: list[float]
    correct: list[int]  # per TTT step: rows where the head's top-1 is the target's top-1
    rows: list[int]  # per TTT step: rows that count
    weighted: float  # ``loss`` as a number, read back with the rest in one transfer


def ttt_loss(head: TrainableHead, batch: Batch, lesson: Lesson, ttt: int, decay: float,
             autocast: torch.dtype | None) -> StepResult:
    n = batch.tokens.shape[1]
    index = torch.arange(n, device=batch.tokens.device)
    context = context_mask(batch.docs, torch.float32)
    steps = [step_inputs(batch.tokens, batch.positions, k, context) for k in range(ttt)]
    with torch.autocast(batch.tokens.device.type, dtype=autocast, enabled=autocast is not None):
        logits = head.unroll(lesson.features, steps)
    total = lesson.features.new_zeros(())
    losses, correct, rows = [], [], []
    draft_ids = head.draft_ids()
    for k, lk in enumerate(logits):
        valid = (shift(batch.docs, 1 + k) == batch.docs) & (index + 1 + k < n)
        wanted = shift(lesson.argmax, 1 + k)
        counted = valid & head.t2d[wanted]  # rows whose target top-1 the draft vocabulary can say
        logp = F.log_softmax(lk.float(), dim=-1)
        ce = -(shift(lesson.probs, 1 + k) * logp).sum(-1)
        loss_k = (ce * counted).sum() / counted.sum().clamp_min(1)
        total = total + decay**k * loss_k
        losses.append(loss_k.detach())
        correct.append(((draft_ids[lk.detach().argmax(-1)] == wanted) & valid).sum())
        rows.append(valid.sum())
    figures = torch.stack([torch.stack(losses), torch.stack(correct).float(), torch.stack(rows).float()]).tolist()
    weighted = sum(decay**k * x for k, x in enumerate(figures[0]))
    return StepResult(total, figures[0], [int(c) for c in figures[1]], [int(r) for r in figures[2]], weighted)


def heldout_metrics(head: TrainableHead, target: torch.nn.Module, batches: list[Batch], s: Settings, device: str,
             autocast: torch.dtype | None) -> dict:
    """Held-out loss and top-1 acceptance per TTT step."""
    head.eval()
    correct, rows, loss = [0] * s.ttt, [0] * s.ttt, 0.0
    with torch.no_grad():
        for b in batches:
            b = b.to(device)
            r = ttt_loss(head, b, teach(target, b, head.cfg.layers, head.draft_ids(), autocast), s.ttt,
                         s.step_decay, autocast)
            loss += r.weighted / len(batches)
            correct = [a + c for a, c in zip(correct, r.correct)]
            rows = [a + c for a, c in zip(rows, r.rows)]
    head.train()
    return {"loss": round(loss, 4), "acceptance": [round(c / max(n, 1), 4) for c, n in zip(correct, rows)]}


def settings_from_checkpoint(state: dict, given: Settings) -> Settings:
    saved = Settings(**{f.name: state["settings"][f.name] for f in fields(Settings) if f.name in state["settings"]})
    for name in RESUMABLE:
        setattr(saved, name, getattr(given, name))
    return saved


def train(s: Settings, resume: bool = False, console: Any = None) -> Path:
    """Run (or continue) training; returns the head directory written at the end."""
    budget = TimeBudget(s.max_minutes, time.perf_counter(), s.checkpoint_minutes)
    from rich.console import Console

    console = console or Console(stderr=True)
    if not console.is_terminal:  # a log file: one line per report, whatever the width
        console = Console(stderr=True, width=220)
    run = Path(s.run).expanduser()
    latest = ckpt.latest_checkpoint(run) if resume else None
    if resume and latest is None:
        raise GraftError(f"--resume: no checkpoint under {run}")
    if not resume and ckpt.latest_checkpoint(run) is not None:
        raise GraftError(f"{run} already holds a checkpoint: pass --resume to continue it, or another --run")
    state = None
    if latest is not None:
        state = json.loads((latest / "state.json").read_text())
        s = settings_from_checkpoint(state, s)
    if s.threads:
        torch.set_num_threads(s.threads)
    if min(s.ttt, s.max_steps, s.seq_len - 2, s.batch_size, s.checkpoint_every, s.heldout_every - 1) < 1:
        raise GraftError("--ttt, --max-steps, --batch-size, --checkpoint-every must be >= 1, --seq-len >= 3 "
                         "and --heldout-every >= 2")
    loaded = _teacher(s)
    target, device = loaded.model, loaded.device
    autocast = torch.bfloat16 if device.startswith("cuda") else None
    t0 = time.perf_counter()
    docs, summary = _documents(s, target, loaded.tokenizer, run)
    train_docs, held_docs = split(docs, s.heldout_every)
    draft_ids, coverage = draft_vocabulary(train_docs, target.config.vocab_size, s.draft_vocab)
    console.print(f"data: {summary}; {len(train_docs):,} training documents ({int(train_docs.starts[-1]):,} tokens), "
                  f"{len(held_docs):,} held out; draft vocabulary {s.draft_vocab:,} covers {coverage:.1%} "
                  f"of training tokens ({time.perf_counter() - t0:.0f} s)")
    packer = Packer(train_docs, s.seq_len, s.batch_size, s.seed)
    heldout = Packer(held_docs, s.seq_len, s.batch_size, s.seed).fixed(s.eval_sequences)
    head = new_head(target, draft_config(target.config, s.draft_vocab), draft_ids, s.seed)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=s.lr,
                                  weight_decay=s.weight_decay)
    meta = {"settings": asdict(s), "tokens": 0, "seconds": 0.0, "history": [], "evals": [],
            "coverage": round(coverage, 4), "corpus": summary, "device": device_name(device)}
    if latest is not None:
        restored = ckpt.load_checkpoint(latest, head, optimizer)
        if not torch.equal(head.draft_ids().cpu(), draft_ids):
            raise GraftError(f"{latest}: the corpus gives another draft vocabulary than the checkpoint's "
                             "(the data changed?)")
        meta.update({k: restored[k] for k in ("tokens", "seconds", "history", "evals")})
        meta["settings"] = asdict(s)
        console.print(f"resumed {latest} at step {restored['step']:,} ({restored['tokens']:,} tokens)")
    start = state["step"] if state else 0
    budget.begin(s, start, time.perf_counter())
    _loop(s, head, target, optimizer, packer, heldout, meta, start, device, autocast, console, run, budget)
    out = Path(s.out).expanduser()
    last = ckpt.latest_checkpoint(run)
    final = ckpt.write_head(head, target.config, out, torch.bfloat16, {"step": s.max_steps, **meta})
    console.print(f"head written to {final} (from {last})")
    return final


def device_name(device: str) -> str:
    """What trained the head, for its record: the GPU's name, or the CPU's."""
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} (torch {torch.__version__})"
    import platform

    cpu = platform.processor() or platform.machine()
    return f"{cpu} CPU, {torch.get_num_threads()} threads (torch {torch.__version__})"


def _teacher(s: Settings) -> Any:
    """The target, loaded frozen: on a CPU in fp32 (a head learns from the target's exact features, and a run
    resumed on a machine with other matrix units must compute the same bits), its linears on packed oneDNN
    kernels (15% faster here), packed whatever the free memory."""
    loaded = load_model(s.model, s.device, "float32" if pick_device(s.device) == "cpu" else "auto", fast_cpu=False)
    if loaded.device == "cpu":
        use_cpu_linears(loaded.model, pack=True)
    for p in loaded.model.parameters():
        p.requires_grad_(False)
    return loaded


def _documents(s: Settings, target: torch.nn.Module, tokenizer: Any, run: Path) -> tuple[Documents, str]:
    """The run's documents and their summary line; with ``--regenerate``, replies are the target's own."""
    regenerator = None
    if s.regenerate:
        regenerator = Regenerator(target, tokenizer, run / "regenerated.jsonl", s.regenerate_tokens)
    docs, summary = read_documents(s.data, tokenizer, s.fields or None, s.max_documents,
                                   regenerator.answer if regenerator else None)
    if regenerator is not None:
        summary += (f"; answers regenerated by the target ({regenerator.generated:,} new, "
                    f"{len(regenerator.known):,} in all)")
    return docs, summary


def _loop(s: Settings, head: TrainableHead, target: torch.nn.Module, optimizer: torch.optim.Optimizer,
          packer: Packer, heldout: list[Batch], meta: dict, start: int, device: str, autocast: torch.dtype | None,
          console: Any, run: Path, budget: TimeBudget) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    params = [p for p in head.parameters() if p.requires_grad]
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn())
    window_tokens, window_t, window_loss = 0, time.perf_counter(), []
    last_eval = meta["evals"][-1]["acceptance"] if meta["evals"] else []
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("train", total=s.max_steps, completed=start, info="")
        done = start
        while done < s.max_steps:  # a time budget moves max_steps as it goes
            t = time.perf_counter()
            batch = packer.batch(done).to(device)
            lesson = teach(target, batch, head.cfg.layers, head.draft_ids(), autocast, full=False)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(s, done)
            result = ttt_loss(head, batch, lesson, s.ttt, s.step_decay, autocast)
            optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
            optimizer.step()
            n = batch.tokens.numel()
            meta["tokens"] += n
            meta["seconds"] += time.perf_counter() - t
            window_tokens += n
            window_loss.append(result.weighted)
            done += 1
            budget.update(s, done, time.perf_counter())
            if done % s.log_every == 0 or done == s.max_steps:
                rate = window_tokens / max(time.perf_counter() - window_t, 1e-9)
                loss = sum(window_loss) / len(window_loss)
                meta["history"].append([done, meta["tokens"], round(loss, 4)])
                acc = " ".join(f"{a:.2f}" for a in last_eval)
                info = f"loss {loss:.3f}  {rate:,.0f} tok/s  held-out top-1/step {acc or '-'}"
                bar.update(task, completed=done, total=s.max_steps, info=info)
                if not console.is_terminal:
                    console.print(f"step {done}/{s.max_steps} tokens {meta['tokens']:,} {info}")
                window_tokens, window_t, window_loss = 0, time.perf_counter(), []
            if done % s.checkpoint_every == 0 or done == s.max_steps or budget.due(time.perf_counter()):
                t = time.perf_counter()
                last_eval = _checkpoint(s, head, target, optimizer, heldout, meta, done, device, autocast, console, run)
                budget.checkpointed(time.perf_counter() - t, time.perf_counter())


def _checkpoint(s: Settings, head: TrainableHead, target: torch.nn.Module, optimizer: torch.optim.Optimizer,
                heldout: list[Batch], meta: dict, done: int, device: str, autocast: torch.dtype | None,
                console: Any, run: Path) -> list[float]:
    """Evaluate on the held-out sequences and write the checkpoint of step ``done``; returns the held-out top-1
    per TTT step."""
    ev = heldout_metrics(head, target, heldout, s, device, autocast)
    meta["evals"].append({"step": done, "tokens": meta["tokens"], **ev})
    meta["settings"] = asdict(s)  # max_steps as a time budget has set it
    path = ckpt.save_checkpoint(run, done, head, optimizer, meta, target.config)
    console.print(f"step {done}: held-out loss {ev['loss']:.3f}, top-1 per TTT step "
                  f"{' '.join(f'{a:.3f}' for a in ev['acceptance'])}; checkpoint {path}")
    return ev["acceptance"]
