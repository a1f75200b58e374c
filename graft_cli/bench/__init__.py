"""The benchmark runner behind ``graft bench``: every method on the same prompts, interleaved, Spec-Bench style.

Protocol (Spec-Bench's): greedy, batch 1, the chat template, multi-turn questions run turn by turn with each
method's own answer put back into its conversation; a question's speed is its new tokens over its wall time,
a method's speed the mean of those, and its speedup that mean over plain decoding's (``ar``). Every method's
tokens must equal ``ar``'s: a mismatch is recorded with its question id and fails the run.

Fairness: one process, each model loaded once, a warm-up per method, and the methods interleaved question by
question (the order rotates from one question to the next) so that machine drift hits all of them alike.
Each finished (question, method) is appended to ``runs.jsonl`` at once, so an interrupted run can resume.

The package, one module a concept: ``options`` (what the command line asked), ``datasets`` (questions),
``plan`` (methods, budgets, variants), ``workload`` (the questions and columns of a run, the options checked),
``runners`` (the engine and transformers peers, memory), ``models`` (loading them once, the columns' runners,
the prompts' fit), ``provenance`` (checksums, commit, versions), ``fingerprints`` (what a resumed run compares),
``runs`` (the runs files: keys, reading, resuming), ``execution`` (interleaving, passes, failures), ``prepare``
(everything before the first forward), ``progress`` (the question phase on screen), ``results`` (figures and
results.json), ``tables`` (the terminal's view), ``answers`` (Spec-Bench answer files), ``report`` (the outputs
and the exit code) and ``command`` (the whole run, phase by phase).
"""
