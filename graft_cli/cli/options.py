"""The command-line options that ``generate`` and ``bench`` share, declared once: each is an annotated type that a
command's signature uses with its own default. Help texts that name a device default read the table in
graft_cli/core/defaults.py rather than restating it."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from dataclasses import fields
from typing import Any

from graft_cli.core.defaults import CPU, CUDA, MAX_LEVELS, PREFIX_CACHE_MIB, both
from graft_cli.core.env import DraftSettings
from graft_cli.core.errors import GraftError
from graft_cli.core.prune import DEFAULT_SCHEDULE
from graft_cli.method.config import ALIAS_HELP, MethodConfig, configure

MODEL, SPECULATION, DEVICE, OUTPUT = "Model", "Speculation", "Device", "Output"

Model = Annotated[str, typer.Option(
    "--model", "-m", rich_help_panel=MODEL, help="Target model: a catalog name (graft models list), a local model directory or .gguf file, or a Hugging Face id ORG/NAME[@REVISION].")]
Draft = Annotated[Optional[str], typer.Option(
    "--draft", rich_help_panel=MODEL,
    help="Draft model (catalog name, path or ORG/NAME), or KIND:SPEC of a drafter plugin (graft plugins list): "
         "eagle3:DIR|NAME|ORG/NAME (graft heads list).")]
Budget = Annotated[Optional[str], typer.Option(
    "--budget", rich_help_panel=SPECULATION,
    help=f"Verified tree nodes per step (default: {both('budget')}), or 'auto': measured on this device once, then "
         "chosen per step. 0: no tree, one token per forward (plain decoding through the verification path; "
         "retrievers still learn).")]
Datastore = Annotated[Optional[str], typer.Option(
    "--datastore", rich_help_panel=SPECULATION, help="Datastore name or path to retrieve from (graft index list).")]
RetrieverOpt = Annotated[List[str], typer.Option(
    "--retriever-opt", rich_help_panel=SPECULATION, help="KEY=VALUE option for retrievers (repeatable).")]
MaxNewTokens = Annotated[int, typer.Option(
    "--max-new-tokens", "-n", min=1, rich_help_panel=OUTPUT, help="New tokens per answer at most (fewer at a stop token).")]
Device = Annotated[str, typer.Option("--device", rich_help_panel=DEVICE, help="auto, cpu or cuda.")]
Dtype = Annotated[str, typer.Option(
    "--dtype", rich_help_panel=DEVICE,
    help="auto (GRAFT_DTYPE if set; on a CPU bfloat16 where it has AMX or AVX512-BF16, else float32; on CUDA "
         "bfloat16 where the card has it, else float16), float32, bfloat16, float16, mixed (CPU: a prompt's "
         "forward in bfloat16, every step in float32), or q4 (CPU: the GGUF's 4-, 5- and 8-bit weights kept as "
         "stored, on torch's 4-bit kernel, bfloat16 arithmetic; docs/quantized.md).")]
Forward = Annotated[str, typer.Option(
    "--forward", rich_help_panel=DEVICE,
    help="Whose modules run the model: own (graft's, for Llama and Qwen2 on a CPU), transformers, or auto (own "
         "where it serves the model and has proven faster; docs/models.md).")]
DeviceMap = Annotated[Optional[str], typer.Option(
    "--device-map", rich_help_panel=DEVICE,
    help="Shard a model larger than one GPU through accelerate: auto (GPUs, then CPU, then disk), balanced, "
         "sequential, or a JSON object of module to device.")]
Truncate = Annotated[Optional[str], typer.Option(
    "--truncate", rich_help_panel=DEVICE,
    help="left or right: cut a prompt that would reach past the model's positions or attention window (default: "
         "refuse it).")]

Method = Annotated[str, typer.Option("--method", rich_help_panel=SPECULATION, help=f"graft, dense, pruned, rest, recycling, pld or ar; vLLM's names work too: {ALIAS_HELP} (docs/architecture.md).")]
TreeShape = Annotated[Optional[str], typer.Option("--tree", rich_help_panel=SPECULATION, help="How graft with a drafter shapes its tree: 'cost' (default: each step by expected tokens per second, docs/architecture.md) or 'fixed' (--depth levels and --prune-at checkpoints).")]
Depth = Annotated[Optional[int], typer.Option("--depth", min=1, rich_help_panel=SPECULATION, help=f"Draft tree levels at most (default: {both('depth')}; {MAX_LEVELS} with --tree cost).")]
DraftTopK = Annotated[Optional[int], typer.Option("--draft-top-k", min=1, rich_help_panel=SPECULATION, help=f"Draft nodes expanded per level and children per node (default: {both('draft_top_k')}).")]
PruneAt = Annotated[Optional[str], typer.Option("--prune-at", rich_help_panel=SPECULATION, help=f"Where the draft tree is cut short when the drafter is unsure: LEVEL:THRESHOLD[:SHARE],... (stop after LEVEL when the best path is less likely than THRESHOLD, keeping SHARE of the budget; default {DEFAULT_SCHEDULE}; 'none': never).")]
Chain = Annotated[bool, typer.Option("--chain", rich_help_panel=SPECULATION, help="Draft one line of tokens instead of a tree; with graft, retrieved tokens continue it (the paper's Graft(TAIL)).")]
DraftVocab = Annotated[Optional[int], typer.Option("--draft-vocab", min=0, rich_help_panel=SPECULATION, help="A draft model scores only N tokens: the most frequent by `graft models vocab` (else the lowest ids), the special ones and the prompt's (default: the ranked tokens covering 99.99% of the corpus on a CPU, all on a GPU or without a ranking; 0: all).")]
DraftWindow = Annotated[Optional[int], typer.Option("--draft-window", rich_help_panel=SPECULATION, help=f"A draft model reads at most the first 4 and last N-4 prompt tokens (default: {both('draft_window')}; 0: the whole prompt). Retrieval reads all of it.")]
DraftAhead = Annotated[Optional[bool], typer.Option("--draft-ahead/--draft-after-read", rich_help_panel=SPECULATION, help="With --graphs on and graft's cost-aware tree: a draft model drafts the next step before a step's result is read (one device read a step), or after it, checking the retrieved chain exactly (the default: measured the faster). An EAGLE-3 head always drafts ahead.")]
DraftWeights = Annotated[Optional[str], typer.Option("--draft-weights", rich_help_panel=SPECULATION, help=f"A draft model's linear weights: 'fp16' (FBGEMM's fp16 kernel, fp32 arithmetic: a CPU draft forward then reads half the bytes) or 'full' (the model's dtype); default: {both('draft_weights')}. The target is never touched.")]
RopeTheta = Annotated[Optional[float], typer.Option("--rope-theta", rich_help_panel=SPECULATION, help="RoPE base of an EAGLE-3 head (default: its config's, else 10000).")]
AdjacencyFile = Annotated[Optional[str], typer.Option("--adjacency-file", rich_help_panel=SPECULATION, help="Keep the recycling adjacency table in FILE across runs (safetensors).")]
Retrievers = Annotated[Optional[str], typer.Option("--retrievers", rich_help_panel=SPECULATION, help="Comma-separated retriever plugins.")]
Graphs = Annotated[str, typer.Option(
    "--graphs", rich_help_panel=DEVICE,
    help="Verify at fixed shapes, each captured once as a CUDA graph (seconds at start-up): auto (on CUDA "
         f"{'on' if CUDA.graphs else 'off'}, on CPU {'on' if CPU.graphs else 'off'}: there the padding costs real "
         "compute), on, off, or compiled: on, each region compiled by torch.compile first (minutes at start-up; "
         "docs/gpu.md). A shape whose capture fails runs eagerly; a compile that fails, uncompiled.")]
Threads = Annotated[Optional[int], typer.Option(
    "--threads", min=1, rich_help_panel=DEVICE,
    help="CPU threads torch runs on (default: OMP_NUM_THREADS if set, else the cores this process may use, as "
         "taskset or a container's cpuset allows).")]
PrefixCache = Annotated[float, typer.Option(
    "--prefix-cache", min=0, metavar="MIB", rich_help_panel=DEVICE,
    help=f"Keep earlier requests' KV rows (the target's and the drafter's), up to MIB mebibytes, so a request that "
         f"begins as an earlier one did feeds only the rest (default {PREFIX_CACHE_MIB}; 0: off).")]
PrefillChunk = Annotated[int, typer.Option("--prefill-chunk", min=1, rich_help_panel=DEVICE, help="Prompt tokens per prefill forward (bounds the prefill's peak memory; a progress bar shows on a terminal when the prefill takes over 2 s).")]


def method_config(params: dict[str, Any]) -> MethodConfig:
    """The method configuration from a command's parameters, named as the shared options above (``generate`` and
    ``serve`` take the same ones), through the one function every caller makes a method with."""
    drafting = {f.name: params[f.name] for f in fields(DraftSettings)}
    return configure(params["method"], budget=params["budget"], retrievers=params["retrievers"],
                     datastore=params["datastore"], adjacency_file=params["adjacency_file"],
                     retriever_options=option_pairs(params["retriever_opt"]), draft=params["draft"],
                     tree=params["tree"], **drafting)


def option_pairs(pairs: list[str]) -> dict[str, str]:
    """``--retriever-opt KEY=VALUE`` pairs as the retriever options they set."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise GraftError(f"--retriever-opt expects KEY=VALUE, got '{pair}'")
        options[key] = value
    return options
