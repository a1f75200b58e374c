"""Host time of one decoding step with the model forwards excluded, and device-to-host reads per step.

On a GPU the target verifies a 60-node tree of an 8B model in about 8-10 ms; every millisecond of Python around
that forward is a millisecond the GPU waits, and every read of a device tensor (``.item()``, ``.tolist()``, ...)
stalls the host until the GPU queue drains. This runs graft at the CUDA defaults (budget 60, depth 7, draft top-k
8, the GPU's pruning floor and latency curve, a cost-aware draft's depth planned before it) on a CPU, times every
model forward (the target's, the draft model's, the EAGLE-3 head's) and subtracts it, and splits what is left by
the phases graft itself times:

``propose``   the proposer besides what nests in it: a drafter's own work and, for the cost-aware proposer (graft
              with a drafter), its retrieval, grafting and decisions
``retrieve``  (a proposer without a cost model) every retriever's lookup and the grafting of their pool
``queue``     (fixed shapes) the next draft, queued before the step's read: on a GPU, while the device verifies
``inputs``    the verification's inputs: ids, positions, the tree mask (the static inputs' write at fixed shapes)
``verify``    the rest of the step: the acceptance and the step's record (at fixed shapes: around the regions,
              and the step's one read)
``keep``      the KV cache compacted to the accepted path (the eager path)
``update``    the proposer learning from the step: retrievers, calibration, the drafter
``loop``      the rest of the decode loop (token lists, counters)

The phases are the product's own. graft reads every second through the ``Recorder`` its builder is handed
(graft_cli/core/timing.py); here that is a :class:`~benchmarks.host_time.phases.HostRecorder`, whose clock is the
modelled one below and which enters each phase graft times with ``Recorder.timed`` on this instrument's host clock
too. ``Stats.times`` so holds the modelled device's seconds, shown below the table. What the instrument wraps
besides, each an instance it builds or whose forwards it records: the target model's forward and the drafter's
models (a draft model and its decoder; an EAGLE-3 head's layer, fusion and LM head), to record and play them back;
their KV-cache layers' ``update``, to log the writes the replay repeats; and the target it builds, whose
``verify``, ``keep``, static inputs' ``write`` and captured regions (``graphs.run``, and the drafter's levels'
alike), and the ``Needs.queue`` hook its ``rule`` hands the step, separate what a GPU runs as a graph, or while it
verifies, from host code. What graft neither times with ``Recorder.timed`` nor runs in one of those objects (the
acceptance, the grafting, a drafter's own draft and observe, which it records as seconds added after the fact) is
not split out: it counts in the phase that calls it.

A TorchFunctionMode sees every torch call: it counts them per phase (each is a kernel launch on a GPU) and the
device-to-host reads among them (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``float()``, ``bool()``,
``int()``, indexing with a tensor, ``np.asarray``); reads inside the model forwards (transformers' own) are shown
apart and not counted in ``syncs_per_step``. On this CPU every tensor op runs at once; a call over a
vocabulary-sized tensor (softmax, top-k, argmax over the logits, KV moves) is device work a GPU runs
asynchronously, so it is timed and excluded like a forward. What remains is Python and small tensor calls (on a
GPU each of those is a kernel launch of a few microseconds, about what a small CPU op costs here). The counting
mode's own cost per call is measured before each pass and subtracted. The clock is this thread's CPU time by
default (``--clock wall`` for perf_counter): on a shared machine wall time mostly measures the neighbours.

The forwards are played back, not run, by default. A CPU forward streams the model's weights (hundreds of MB)
through this machine's caches, and the host code right after it runs many times slower on cold caches
(``--cold-caches``: a 60-node tree's ancestor mask takes 18 us warm, 190 us after a 128 MB matmul). A GPU's forward
leaves the host's caches alone, so that slowdown does not transfer. So the decoding is done more than once:

1. **record**: the real decoding, every model forward run; its outputs, its writes to the KV caches (rows and
   shapes) and the outputs of every vocabulary-wide call outside the forwards are kept;
2. **replay** (``--repeat`` times, the quietest shown): the same decoding from the same start (a proposer built
   alike), every forward replaced by its recorded outputs and its cache writes by their rows (each layer's filled
   rows advance; no keys or values move, as on a GPU, whose writes stay in its own memory; ``--write-kv`` writes
   zeros of the recorded shapes into the host's memory, whose traffic evicts the host code's caches), every
   vocabulary-wide call by its recorded output: the host code runs exactly as before, minus the device's work.
   Only the replays are timed. Should a forward's rows or a call differ from the record, or the tokens at the
   end, the replay stops with an error: its timing would not be of the same decoding.

Every pass runs on one modelled clock, the recorder's: a target forward costs ``--target-ms`` times the CUDA latency
curve, a draft forward ``--draft-share`` of that, and host code nothing. So the cost-aware decisions are the same
in every pass, and they are the decisions a GPU's costs would make. ``--in-run`` times the record pass instead:
the forwards run inline, as they do on this CPU. The cost-aware tree builder runs planned, as off the CPU (one
device read per draft; none with ``--fixed-shapes`` and a head, whose draft rides in the step's read;
``--read-per-level``: one per level, the CPU's way). :func:`measure` is what benchmarks/gpu_check.py and
benchmarks/gpu_fixed.py call for their host rows.

    python -m benchmarks.host_time --drafter model|eagle3|none --threads 1
    python -m benchmarks.host_time --cold-caches
    python -m benchmarks.host_time --drafter eagle3 --threads 1 --fixed-shapes   # the fixed-shape path, eagerly

``--fixed-shapes`` runs the fixed-shape path (graft_cli/runtime/fixed_target.py) eagerly: the verification, the
acceptance and the drafter's levels run as the regions a GPU captures, and each region's own time is shown as
``captured`` and excluded like a forward (on a GPU it is one graph replay, a few microseconds of launch).

From the command line the suffix-array store is built once from one Alpaca-Eval output file
(``$GRAFT_HOME/datastores/host-overhead``); the EAGLE-3 head has random weights (in a temporary directory), scaled
so that its tree grows.
"""

from benchmarks.host_time.instrument import Measured, measure

__all__ = ["Measured", "measure"]
