"""`graft heads train | list | eval | ship`: EAGLE-3 heads trained by graft (graft_cli/heads/, docs/heads.md).
Results go to stdout; progress and logs to stderr."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from graft_cli.catalog.entries import DEFAULT_MODEL

heads_app = typer.Typer(no_args_is_help=True, help="EAGLE-3 draft heads: train, list, evaluate, ship.")


def _head_dir(out: Optional[str], name: Optional[str]) -> Path:
    from graft_cli.core import GraftError
    from graft_cli.heads import user_heads_dir

    if (out is None) == (name is None):
        raise GraftError("give exactly one of --out DIR or --name NAME")
    if name is not None and ("/" in name or name.startswith(".") or not name.strip()):
        raise GraftError(f"--name {name!r} must be a plain name (no '/')")
    return Path(out).expanduser() if out is not None else user_heads_dir() / name


@heads_app.command("train")
def train(
    data: List[str] = typer.Option(..., "--data", help="Corpus: JSONL, Parquet/Arrow files or folders (repeatable), "
                                   "or one packed token file (.npz)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="Target model (catalog name or path)."),
    out: Optional[str] = typer.Option(None, "--out", help="Write the trained head to this directory."),
    name: Optional[str] = typer.Option(None, "--name", help="Write the trained head to GRAFT_HOME/heads/NAME."),
    run: Optional[str] = typer.Option(None, "--run", help="Checkpoint directory (default GRAFT_HOME/train/NAME)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run's newest checkpoint exactly."),
    max_steps: int = typer.Option(2000, "--max-steps", help="Optimiser steps in all (the cosine schedule ends here)."),
    max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="End by this wall time: the schedule "
                                                "shrinks to the steps that fit, then a last checkpoint."),
    ttt: int = typer.Option(7, "--ttt", help="Training-time-test steps unrolled per batch."),
    step_decay: float = typer.Option(0.8, "--step-decay", help="Loss weight of TTT step k: DECAY**k."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="Draft vocabulary: the N most frequent tokens."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per packed sequence."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per step."),
    lr: float = typer.Option(3e-4, "--lr", help="Peak AdamW learning rate."),
    warmup: int = typer.Option(50, "--warmup", help="Linear warm-up steps."),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", help="Evaluate and checkpoint every N steps."),
    checkpoint_minutes: Optional[float] = typer.Option(None, "--checkpoint-minutes", help="Also evaluate and "
                                                       "checkpoint whenever this much wall time has passed since "
                                                       "the last checkpoint."),
    log_every: int = typer.Option(10, "--log-every", help="Progress line every N steps."),
    heldout_every: int = typer.Option(100, "--heldout-every", help="Hold out 1 document in N."),
    eval_sequences: int = typer.Option(16, "--eval-sequences", help="Held-out sequences evaluated per checkpoint."),
    field: List[str] = typer.Option([], "--field", help="Record fields to read (JSONL/Parquet); default: auto."),
    max_documents: Optional[int] = typer.Option(None, "--max-documents", help="Read at most N documents."),
    regenerate: bool = typer.Option(False, "--regenerate", help="Train on the target's own greedy answers to the "
                                    "corpus' instructions (cached in the run directory; slow on a CPU)."),
    regenerate_tokens: int = typer.Option(256, "--regenerate-tokens", help="Longest regenerated answer."),
    seed: int = typer.Option(0, "--seed", help="Seed of the initialisation and the data order."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda (bf16 autocast on CUDA)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads (torch.set_num_threads)."),
) -> None:
    """Train an EAGLE-3 head for MODEL on a corpus (resumable; see docs/heads.md)."""
    from graft_cli.catalog.home import graft_home
    from graft_cli.heads.train import Settings, train as run_training

    dest = _head_dir(out, name)
    settings = Settings(
        model=model, data=list(data), run=str(Path(run).expanduser() if run else graft_home() / "train" / dest.name),
        out=str(dest), fields=list(field), max_steps=max_steps, ttt=ttt, step_decay=step_decay,
        draft_vocab=draft_vocab, seq_len=seq_len, batch_size=batch_size, lr=lr, warmup=warmup,
        checkpoint_every=checkpoint_every, log_every=log_every, heldout_every=heldout_every, eval_sequences=eval_sequences,
        max_documents=max_documents, regenerate=regenerate,
        regenerate_tokens=regenerate_tokens, seed=seed, device=device, threads=threads, max_minutes=max_minutes,
        checkpoint_minutes=checkpoint_minutes,
    )
    typer.echo(str(run_training(settings, resume=resume)))


@heads_app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="One JSON array on stdout.")) -> None:
    """Named heads (shipped with graft, then GRAFT_HOME/heads), for --draft eagle3:NAME."""
    from graft_cli.heads import SHIPPED, named_heads

    rows = []
    for head_name, path in named_heads().items():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        rows.append({"name": head_name, "shipped": path.parent == SHIPPED, "path": str(path),
                     "draft_vocab": config.get("draft_vocab_size"), "hidden": config.get("hidden_size")})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("no named heads (train one: graft heads train --data CORPUS --name NAME)")
    for r in rows:
        typer.echo(f"{r['name']}\t{'shipped' if r['shipped'] else 'user'}\tdraft vocab {r['draft_vocab']}\t{r['path']}")


@heads_app.command("ship")
def ship(
    run: str = typer.Option(..., "--run", help="The training run's checkpoint directory."),
    out: str = typer.Option(..., "--out", help="Head directory to write (e.g. graft_cli/heads/shipped/NAME)."),
    command: str = typer.Option("", "--command", help="The training command, recorded in the README."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Also draw the loss and acceptance curves to this PNG."),
) -> None:
    """Turn a run's newest checkpoint into a shipped head: bf16 weights, config, README with its sha256."""
    from graft_cli.heads.ship import ship as ship_head

    out_dir = ship_head(Path(run).expanduser(), Path(out).expanduser(), command)
    if plot:
        from graft_cli.bench.plots import training_curves

        training_curves(json.loads((out_dir / "training.json").read_text()), Path(plot).expanduser())
    typer.echo(str(out_dir))


@heads_app.command("eval")
def eval_(
    head: str = typer.Argument(..., help="Head: a named head (graft heads list) or a directory."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="Target model (catalog name or path)."),
    dataset: str = typer.Option("spec-bench", "--dataset", "-d", help="spec-bench, mt-bench or a JSONL file."),
    limit: Optional[int] = typer.Option(None, "--limit", help="The first N questions of each category."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Greedy continuation per prompt."),
    steps: int = typer.Option(7, "--steps", help="Draft steps (chain depth) to score."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Acceptance per draft step on real prompts, teacher-forced over the target's greedy continuations."""
    import torch

    from graft_cli.bench.datasets import load_questions, resolve_dataset
    from graft_cli.heads import load_head
    from graft_cli.core import GraftError
    from graft_cli.heads.evaluate import evaluate_head
    from graft_cli.runtime.loading import encode, load_model

    if steps < 1 or max_new_tokens < 2:
        raise GraftError("--steps must be >= 1 and --max-new-tokens >= 2")
    if threads:
        torch.set_num_threads(threads)
    questions = load_questions(resolve_dataset(dataset), limit=limit)
    loaded = load_model(model, device)
    loaded_head = load_head(head, loaded.model)
    prompts = [encode(loaded.tokenizer, q.turns[0]) for q in questions]
    typer.echo(f"{len(prompts)} prompts, {max_new_tokens} greedy tokens each", err=True)
    report = evaluate_head(loaded, loaded_head, prompts, max_new_tokens, steps,
                           on_prompt=lambda i: typer.echo(f"  prompt {i + 1}/{len(prompts)}", err=True))
    report = {"head": head, "model": model, "dataset": dataset, "prompts": len(prompts), **report}
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(f"head {head} on {model}: {report['prompts']} prompts of {dataset}, {report['positions']} positions")
    typer.echo("step  accepted-given-previous  chain-accepted")
    for k, (s, c) in enumerate(zip(report["step_acceptance"], report["chain_acceptance"])):
        typer.echo(f"{k:>4}  {s:>23.3f}  {c:>14.3f}")
    typer.echo(f"tokens per target forward with a {steps}-step chain: {report['tokens_per_forward']:.2f}")
