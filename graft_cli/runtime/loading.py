"""Loading a model and its tokenizer for generation: device and dtype choice, chat formatting, stop tokens.

Loading itself reaches no network (``local_files_only``): a spec is first resolved to a local directory (the catalog,
a path, or a hub id's snapshot in the Hugging Face cache, downloaded there first if it is missing:
graft_cli/catalog/resolve.py).
Loading changes nothing else in the process: transformers' logging is quieted for the load's duration only.

``device_map`` (``--device-map auto``) shards a model larger than one GPU through accelerate: its layers spread
over the visible GPUs, then the CPU, then disk. Inputs go to the input embedding's device (``Loaded.device``,
``Target.device``), each layer's KV cache lives where the layer runs, and logits come back to the input device.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from graft_cli.catalog.q4 import FILE as FOUR_BIT_FILE
from graft_cli.catalog.resolve import resolve_model
from graft_cli.core import GraftError
from graft_cli.core.cpu_units import cpu_units
from graft_cli.models import FORWARDS, own_model, servable
from graft_cli.models.config import plain_config, plain_generation
from graft_cli.models.decoder import FUSED
from graft_cli.models.tokenizer import light_tokenizer
from graft_cli.runtime.cpu_linear import CpuLinear, packed_dtypes, use_cpu_linears
from graft_cli.runtime.prompt_precision import add_prompt_copies
from graft_cli.runtime.limits import Limits, limits
from graft_cli.runtime.target import input_device

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
DTYPES = ("auto", "float32", "bfloat16", "float16", "mixed", "q4")
OWN_BY_DEFAULT = True  # --forward auto: graft's own forward where it serves the model, measured faster (docs/models.md)


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    path: Path
    spec: str  # what the user asked for (catalog name, path or hub id)

    @property
    def device(self) -> str:
        """Where inputs go: the input embedding's device (the only one unless the model is sharded)."""
        return str(input_device(self.model))

    @property
    def limits(self) -> Limits:
        return limits(self.model.config)


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GraftError("--device cuda was asked for but no CUDA device is available")
    if device != "cpu" and not device.startswith("cuda"):
        raise GraftError(f"unknown device '{device}' (use auto, cpu or cuda)")
    return device


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto``: ``GRAFT_DTYPE`` where set; else on a CPU bf16 where it multiplies bf16 in hardware (AMX or
    AVX512-BF16: there a packed bf16 step takes about 0.6 of fp32's time, docs/models.md) and fp32 elsewhere
    (emulated bf16 is slower), on a GPU bf16 where it has it, else fp16. ``mixed`` (a CPU's prompts in bf16,
    graft_cli/runtime/prompt_precision.py) holds fp32 weights."""
    if dtype == "auto" and os.environ.get("GRAFT_DTYPE", "auto") != "auto":
        if os.environ["GRAFT_DTYPE"] not in DTYPES:
            raise GraftError(f"GRAFT_DTYPE: unknown dtype '{os.environ['GRAFT_DTYPE']}' (use {', '.join(DTYPES)})")
        return pick_dtype(os.environ["GRAFT_DTYPE"], device)
    if dtype in ("mixed", "q4") and device != "cpu":
        raise GraftError(f"--dtype {dtype} is a CPU mode (docs/models.md); on a GPU use bfloat16")
    if dtype == "mixed":
        return torch.float32
    if dtype == "q4":  # the 4-bit kernel multiplies bf16 inputs (graft_cli/models/four_bit.py)
        return torch.bfloat16
    if dtype == "auto":
        if device == "cpu":
            return torch.bfloat16 if cpu_units().bf16 else torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise GraftError(f"unknown dtype '{dtype}' (use {', '.join(DTYPES)})")
    return table[dtype]


def parse_device_map(text: str | None) -> str | dict | None:
    """``--device-map``: accelerate's auto, balanced, balanced_low_0 or sequential, or a JSON object of module
    name to device (``{"model.layers.0": 0, "model.layers.1": "cpu", ...}``)."""
    if text is None or isinstance(text, dict):
        return text
    if text.strip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise GraftError(f"--device-map: invalid JSON ({e.msg})") from None
        if not isinstance(value, dict) or not value:
            raise GraftError("--device-map: expected a JSON object of module name to device")
        return value
    if text not in DEVICE_MAPS:
        raise GraftError(f"unknown --device-map '{text}' (use {', '.join(DEVICE_MAPS)} or a JSON object)")
    return text


def load_model(spec: str, device: str = "auto", dtype: str = "auto", device_map: str | dict | None = None,
               fast_cpu: bool = True, forward: str = "transformers") -> Loaded:
    """A catalog name, a local path (HF directory or .gguf) or a hub id to a ready model on ``device``, or sharded by
    ``device_map`` (accelerate's placement; see the module docstring). ``fast_cpu``: the CPU kernels below
    (training packs its own: whether weights get packed here depends on free memory, and a resumed run must compute
    the same bits as the run it continues). ``forward``: whose modules run it (:func:`own_forward`); transformers'
    unless asked, since callers such as ``graft bench``'s peers call transformers' methods (``generate``) on it."""
    device = pick_device(device)
    dtype = (os.environ.get("GRAFT_DTYPE") or "auto") if dtype == "auto" else dtype  # a mode, not just a dtype
    torch_dtype = pick_dtype(dtype, device)
    if device == "cpu" and (torch_dtype == torch.bfloat16 or dtype == "mixed") and not cpu_units().bf16:
        print(f"graft: note: this CPU has no bf16 matrix unit (AMX or AVX512-BF16: {cpu_units().summary()}); "
              "bfloat16 runs emulated, slower than float32", file=sys.stderr)
    device_map = parse_device_map(device_map)
    path = Path(resolve_model(spec))
    check_forward(forward)
    plain = plain_config(path) if forward != "transformers" or dtype == "q4" else None
    if dtype == "q4":  # graft's own forward whatever ``forward`` says: no other runs the 4-bit kernel
        if plain is None or not servable(plain, device, device_map):
            raise GraftError("--dtype q4 runs on graft's own forward: Llama and Qwen2 models, whole on a CPU "
                             "(docs/models.md)")
        model, tokenizer, own = _own(path, plain, torch_dtype, four_bit=True), _tokenizer(path, light=True), True
    elif plain is not None and own_forward(forward, plain, device, device_map):
        model, tokenizer, own = _own(path, plain, torch_dtype), _tokenizer(path, light=True), True
    else:
        model, own = _transformers(path, forward, device, device_map, torch_dtype)
        tokenizer = _tokenizer(path, light=False)
    if device_map is None:
        model.to(device)
    model.eval()
    # the faster CPU linear kernels (cpu_linear.py); a sharded model's modules belong to accelerate
    if device == "cpu" and device_map is None and fast_cpu and next(model.parameters()).dtype in packed_dtypes():
        use_cpu_linears(model)
        if dtype == "mixed":
            add_prompt_copies(model)
        if own:
            release_stacked(model)
    return Loaded(model, tokenizer, path, spec)


def _own(path: Path, config: Any, dtype: torch.dtype, four_bit: bool = False) -> Any:
    """graft's own forward over a plainly read config, without transformers (graft_cli/models/config.py);
    ``four_bit``: over the quantized weights the directory keeps (graft_cli/models/four_bit.py)."""
    limits(config)
    if four_bit and not (path / FOUR_BIT_FILE).is_file():  # said here, where the fix can be named
        raise GraftError(f"{path.name} keeps no quantized weights: --dtype q4 needs a model converted from a GGUF "
                         "whose linears are Q4_0, Q4_1, Q4_K, Q5_0, Q5_1 or Q8_0, by this graft or later "
                         "(graft models pull NAME --force)")
    try:
        return own_model(config, path, dtype, plain_generation(path), four_bit)
    except Exception as e:  # corrupt or missing weights
        raise GraftError(f"cannot load model from {path}: {_first_line(e)}") from e


def _transformers(path: Path, forward: str, device: str, device_map: str | dict | None,
                  dtype: torch.dtype) -> tuple[Any, bool]:
    """The model through transformers' config (its modules, or graft's own where ``forward`` picks them), and
    whether the modules are graft's."""
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: seconds that graft's own forward skips

    with quiet_transformers():
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:
            raise GraftError(f"cannot load model from {path}: {_first_line(e)}") from e
        limits(config)  # refuses layers that are not attention before a weight is read
        placement = {}
        if device_map is not None:  # weights that fit nowhere else go to disk, under the temp directory
            placement = dict(device_map=device_map, offload_folder=os.path.join(tempfile.gettempdir(), "graft-offload"))
        own = own_forward(forward, config, device, device_map)
        try:
            if own:
                return own_model(config, path, dtype, generation_config(path)), True
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                        local_files_only=True, **placement), False
        except Exception as e:  # corrupt weights, missing files, unsupported architecture, a bad device map
            raise GraftError(f"cannot load model from {path}: {_first_line(e)}") from e


def _tokenizer(path: Path, light: bool) -> Any:
    """The model's tokenizer: read without transformers where ``light`` and graft_cli/models/tokenizer.py's rule
    allow it, else transformers'."""
    tokenizer = light_tokenizer(path) if light else None
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer  # lazy: as in _transformers

    with quiet_transformers():
        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:
            raise GraftError(f"cannot load the tokenizer from {path}: {_first_line(e)}") from e


def release_stacked(model: torch.nn.Module) -> None:
    """Drop the plain weights of graft's own forward's stacked projections once packed: stacking made them new
    copies (the checkpoint's own tensors are memory-mapped), and nothing but the packed copy is read of them (other
    code reads only the embeddings and the LM head), so the forward holds no more memory than transformers'."""
    for name, module in model.named_modules():
        if isinstance(module, CpuLinear) and module.packed is not None and name.endswith(tuple(FUSED)):
            module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def own_forward(forward: str, config: Any, device: str, device_map: object) -> bool:
    """``--forward``: whether graft's own modules run the model (graft_cli/models) rather than transformers'.
    ``own`` asks for them (a model they cannot run is refused), ``transformers`` never, ``auto`` where they serve
    the model and ``OWN_BY_DEFAULT`` says they have proven faster."""
    check_forward(forward)
    fits = servable(config, device, device_map)
    if forward == "own" and not fits:
        raise GraftError("--forward own: graft's own forward runs Llama and Qwen2 models whole on a CPU; "
                         "use --forward transformers for this one")
    return fits and (forward == "own" or (forward == "auto" and OWN_BY_DEFAULT))


def check_forward(forward: str) -> None:
    """A ``--forward`` value graft knows, or a one-line error (before anything loads)."""
    if forward not in FORWARDS:
        raise GraftError(f"unknown --forward '{forward}' (use {', '.join(FORWARDS)})")


def generation_config(path: Path) -> Any:
    """The model directory's generation config (its stop tokens), None where it has none."""
    if not (path / "generation_config.json").exists():
        return None
    from transformers import GenerationConfig  # only graft's own forward needs it apart from the model

    return GenerationConfig.from_pretrained(path, local_files_only=True)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars off while graft loads a model, then as they were: stderr carries
    graft's own progress and logs, and a program that loads through graft keeps its own logging settings."""
    from transformers.utils import logging as hf_logging  # lazy: as in _transformers

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def stop_ids(loaded: Loaded) -> set[int]:
    """Tokens that end a generation: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    for holder in (getattr(loaded.model, "generation_config", None), loaded.tokenizer):
        eos = getattr(holder, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids


def encode(tokenizer: Any, prompt: str | list[dict], raw: bool = False, tools: list[dict] | None = None) -> list[int]:
    """Prompt text or chat messages to token ids, through the chat template unless ``raw``; ``tools`` (OpenAI
    function tools) rendered by the template, which must know them."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise GraftError("the prompt is empty")
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = prompt
        if not messages:
            raise GraftError("the messages list is empty")
    if raw or not getattr(tokenizer, "chat_template", None):
        text = prompt if isinstance(prompt, str) else "\n".join(m.get("content", "") for m in messages)
        return tokenizer.encode(text, add_special_tokens=True)
    if tools and (raw or "tools" not in (getattr(tokenizer, "chat_template", None) or "")):
        raise GraftError("this model's chat template knows no tools: serve a model whose template renders them "
                         "(qwen2.5-coder-0.5b-instruct does)")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **({"tools": tools} if tools else {}))
    except Exception as e:
        raise GraftError(f"cannot apply the chat template: {_first_line(e)}") from e
    return tokenizer.encode(text, add_special_tokens=False)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
