"""``graft generate`` in two checkouts, every method greedy and seeded: whether the texts are identical.

    python -m benchmarks.same_outputs --before ../old-checkout --after . [--datastore NAME] [-n 64] [--out FILE]

A refactor that changes no behaviour must leave every method's text as it was, greedy and sampled with a seed.
Each checkout runs its own ``.venv/bin/graft`` on one prompt per method and setting (the default model; the draft
model is the default model drafting for itself, the head the catalog's shipped one); one line per run, and the
count of identical ones.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

PROMPT = "Write a Python function that reads a JSON file and returns its contents, with error handling."
HEAD = "eagle3:smollm2-135m-instruct-eagle3"
DRAFT = "smollm2-135m-instruct"
METHODS = {  # name -> graft generate flags
    "ar": ["--method", "ar"],
    "pld": ["--method", "pld"],
    "recycling": ["--method", "recycling"],
    "rest": ["--method", "rest", "--datastore", "{datastore}"],
    "dense (head)": ["--method", "dense", "--draft", HEAD],
    "pruned (draft model)": ["--method", "pruned", "--draft", DRAFT],
    "graft": ["--method", "graft"],
    "graft (head)": ["--method", "graft", "--draft", HEAD],
    "graft (draft model)": ["--method", "graft", "--draft", DRAFT, "--datastore", "{datastore}"],
    "graft (head, budget auto)": ["--method", "graft", "--draft", HEAD, "--budget", "auto"],
}
SETTINGS = {"greedy": [], "seeded": ["--temperature", "0.8", "--top-p", "0.95", "--seed", "5"]}


def generate(tree: Path, flags: list[str], tokens: int) -> str:
    """The text one checkout's ``graft generate`` writes (one thread: the same arithmetic on both sides)."""
    cmd = [str(tree / ".venv/bin/graft"), "generate", PROMPT, "-n", str(tokens), *flags]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        return f"(exit {done.returncode}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''})"
    return done.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--datastore", default="host-overhead", help="a suffix-array datastore both checkouts can open")
    ap.add_argument("-n", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines, same = [], 0
    for name, flags in METHODS.items():
        for setting, extra in SETTINGS.items():
            made = [flag.format(datastore=args.datastore) for flag in flags] + extra
            before, after = (generate(tree, made, args.n) for tree in (args.before, args.after))
            same += before == after and not before.startswith("(exit")
            lines.append(f"{name:28} {setting:7} {'identical' if before == after else 'DIFFERENT'}"
                         f" ({len(after)} characters)")
            print(lines[-1], flush=True)
    lines.append(f"identical: {same} of {len(METHODS) * len(SETTINGS)}")
    print(lines[-1])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
