"""The benchmark runner behind ``graft bench``: every method on the same prompts, interleaved, Spec-Bench style.

Protocol (Spec-Bench's): greedy, batch 1, the chat template, multi-turn questions run turn by turn with each
method's own answer put back into its conversation; a question's speed is its new tokens over its wall time,
a method's speed the mean of those, and its speedup that mean over plain decoding's (``ar``). Every method's
tokens must equal ``ar``'s: a mismatch is recorded with its question id and fails the run.

Fairness: one process, each model loaded once, a warm-up per method, and the methods interleaved question by
question (the order rotates from one question to the next) so that machine drift hits all of them alike.
Each finished (question, method) is appended to ``runs.jsonl`` at once, so an interrupted run can resume.

The package, one module a concept: ``datasets`` (questions), ``plan`` (methods, budgets, variants),
``runners`` (the engine and transformers peers, memory), ``execution`` (interleaving, resume, shards),
``results`` (figures, table, answer files, results.json) and ``command`` (the whole run).
"""
