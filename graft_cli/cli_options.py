"""The command-line options that ``generate`` and ``bench`` share, declared once: each is an annotated type that a
command's signature uses with its own default. Help texts that name a device default read the table in
graft_cli/core/defaults.py rather than restating it."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from graft_cli.core.defaults import both
from graft_cli.core.errors import GraftError
from graft_cli.core.env import Options

MODEL, SPECULATION, DEVICE = "Model", "Speculation", "Device"

Model = Annotated[str, typer.Option(
    "--model", "-m", rich_help_panel=MODEL, help="Target model: a catalog name, a Hugging Face model directory or a .gguf file.")]
Draft = Annotated[Optional[str], typer.Option(
    "--draft", rich_help_panel=MODEL,
    help="Draft model (catalog name or path), or KIND:SPEC of a drafter plugin (graft plugins list): eagle3:DIR|NAME "
         "(graft heads list).")]
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
    "--max-new-tokens", "-n", min=1, help="New tokens per answer at most (fewer at a stop token).")]
Device = Annotated[str, typer.Option("--device", rich_help_panel=DEVICE, help="auto, cpu or cuda.")]
Dtype = Annotated[str, typer.Option(
    "--dtype", rich_help_panel=DEVICE,
    help="auto (float32 on CPU, bfloat16 on CUDA where the card has it, else float16), float32, bfloat16 or float16.")]
DeviceMap = Annotated[Optional[str], typer.Option(
    "--device-map", rich_help_panel=DEVICE,
    help="Shard a model larger than one GPU through accelerate: auto (GPUs, then CPU, then disk), balanced, "
         "sequential, or a JSON object of module to device.")]
Truncate = Annotated[Optional[str], typer.Option(
    "--truncate", rich_help_panel=DEVICE,
    help="left or right: cut a prompt that would reach past the model's positions or attention window (default: "
         "refuse it).")]


def retriever_options(pairs: list[str], datastore: str | None) -> Options:
    """``--retriever-opt KEY=VALUE`` pairs and ``--datastore`` as the options every retriever is built with."""
    options = Options()
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise GraftError(f"--retriever-opt expects KEY=VALUE, got '{pair}'")
        options[key] = value
    if datastore:
        options["datastore"] = datastore
    return options
