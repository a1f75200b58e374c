"""What the response cache does for a repeated request: the same greedy request twice through `graft serve` with
its response cache, τ, tokens/s and accepted tokens of each (the second answer can come from the first).

    python -m benchmarks.serve_cache [--model smollm2-135m-instruct] [--tokens 128]
"""

from __future__ import annotations

import os

from benchmarks.serve_cost import request_options, served, through_server


def main() -> None:
    args = request_options(__doc__.split("\n\n")[0]).parse_args()
    with served(args.model, []) as client:
        for label in ("first", "second"):
            wall, n, figures = through_server(client, args.model, args.tokens, False)
            print(f"  response cache, {label} request: tau {figures['tau']:.2f}, {n / wall:.1f} tok/s, "
                  f"accepted {figures['accepted']}")


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
