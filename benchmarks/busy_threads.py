"""Plain decoding beside a busy process: tokens/s alone and beside N processes that spin on the CPU, for each
thread count and OpenMP wait policy, so what a busy machine costs is read as a ratio measured minutes apart.

    python -m benchmarks.busy_threads [--threads 1,2] [--busy 1] [-n 48] [--repeats 3]

Each configuration runs in a fresh process (OpenMP reads its wait policy when torch is imported): ``spin`` is
libgomp's default (spin about 3 ms, then sleep), ``passive`` sleeps at once, ``brief`` is what ``graft generate``
and ``graft serve`` set (a thirtieth of the default's spinning; graft_cli/core/threads.py). Decoding only: the load and a warm-up are not timed. Alone and busy runs alternate,
and each is the best of ``--repeats``, so that other work on a shared machine blurs the ratio less.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

PROMPT = "Write a Python function that reads a JSON file and returns its contents."
POLICIES = {"spin": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "brief": {}}


def child(args: argparse.Namespace) -> None:
    """One configuration: the model loaded on ``--threads`` threads, 8 tokens of warm-up, then the timed run."""
    import graft_cli

    with graft_cli.load(args.model, method="ar", device="cpu", threads=args.threads[0]) as g:
        g.generate(PROMPT, max_new_tokens=8)
        stats = g.generate(PROMPT, max_new_tokens=args.n).stats
    print(f"{stats.tokens_per_s:.3f}")


def measure(args: argparse.Namespace, threads: int, policy: str, busy: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(POLICIES[policy])
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        out = subprocess.run([sys.executable, "-m", "benchmarks.busy_threads", "--child", "--threads", str(threads),
                              "--model", args.model, "-n", str(args.n)], env=env, capture_output=True, text=True,
                             check=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:  # a collapsed run: at most n tokens in the whole time allowed
        return args.n / args.timeout
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="thread counts (default: 1 and the cores this process may use)")
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the measured one")
    parser.add_argument("-n", type=int, default=48, help="tokens decoded")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, the best kept")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a run may take (load included); a slower one counts as n/timeout tok/s")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    from graft_cli.core.threads import available_cores

    cores = available_cores()
    print(f"{cores} cores; load average before: {os.getloadavg()[0]:.2f}; {args.busy} busy process(es); "
          f"ar, {args.n} tokens, {args.model}")
    print(f"{'threads':>7} {'policy':>8} {'alone tok/s':>12} {'busy tok/s':>11} {'slowdown':>9}")
    for threads in args.threads or sorted({1, cores}):
        for policy in POLICIES:
            runs = [(measure(args, threads, policy, 0), measure(args, threads, policy, args.busy))
                    for _ in range(args.repeats)]
            alone, busy = max(r[0] for r in runs), max(r[1] for r in runs)
            print(f"{threads:>7} {policy:>8} {alone:>12.2f} {busy:>11.2f} {alone / busy:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
