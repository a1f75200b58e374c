"""How long ``graft generate "Hi" -n 1`` takes from a cold process to its answer, and where the time goes.

    python -m benchmarks.startup [--model smollm2-135m-instruct] [--runs 3] [--forward auto|own|transformers]
                                 [--dtype auto|float32|bfloat16|q4]

Two views: the whole command run ``--runs`` times (wall seconds, the CPU seconds it used, which a machine shared
with other work inflates less, and its peak resident memory: the model's footprint and the runtime's), then one process timing its phases in order on the process's CPU clock:
importing torch, transformers' model classes, graft's generator, loading the model (weights packed for the CPU
kernels included), and the first token. The model must already be pulled.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

PHASES = """
import time
clock = time.process_time
marks = [("start", time.perf_counter(), clock())]
def mark(name):
    marks.append((name, time.perf_counter(), clock()))
import torch; mark("import torch")
{models}from graft_cli.api import open_generator; from graft_cli.method.config import configure; mark("import graft")
g = open_generator({model!r}, configure("graft"), threads=1, forward={forward!r}, dtype={dtype!r})
mark("load the model")
g.generate("Hi", max_new_tokens=1); mark("first token")
for (_, w0, c0), (name, w1, c1) in zip(marks, marks[1:]):
    print(f"{{name:<28}} {{w1 - w0:6.2f}} s wall {{c1 - c0:6.2f}} s CPU")
"""
MODELS = """import transformers.modeling_utils; mark("import transformers' models")\n"""  # graft's own forward: never


def whole_command(model: str, runs: int, forward: str, dtype: str) -> None:
    """The command from a cold process, ``runs`` times; the peak resident memory is the largest of any run (the
    children's maximum, which is what the kernel keeps)."""
    graft = os.path.join(os.path.dirname(sys.executable), "graft")
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([graft, "generate", "Hi", "-n", "1", "--model", model, "--threads", "1",
                        "--forward", forward, "--dtype", dtype], check=True, capture_output=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(f"graft generate \"Hi\" -n 1 --dtype {dtype}: {wall:6.2f} s wall {cpu:6.2f} s CPU, peak resident "
              f"{after.ru_maxrss / 1024:.0f} MB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--forward", default="auto", help="whose modules run the model (graft's --forward)")
    parser.add_argument("--dtype", default="auto", help="graft's --dtype (q4: the GGUF's 4-bit weights)")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    whole_command(args.model, args.runs, args.forward, args.dtype)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TRANSFORMERS_VERBOSITY="error")
    phases = PHASES.format(model=args.model, forward=args.forward, dtype=args.dtype,
                           models=MODELS if args.forward != "own" else "")
    subprocess.run([sys.executable, "-c", phases], check=True, env=env)


if __name__ == "__main__":
    main()
