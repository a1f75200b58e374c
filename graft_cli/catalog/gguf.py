"""GGUF files: a cheap structural check, the once-only dequantisation into a float32 Hugging Face dir (checked
by reloading it and comparing logits) with its quantized weights kept beside it (graft_cli/catalog/q4.py), and the
remembered sha256 of a local .gguf."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import time
from pathlib import Path
from typing import Any, Iterator

from datastores.atomic import write_text_atomic
from datastores.integrity import file_sha256
from graft_cli.catalog.home import ensure_dir, graft_home
from graft_cli.catalog.q4 import write_q4
from graft_cli.core import GraftError

# ChatML, the template both catalog families use; only applied when a GGUF carries no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def check_gguf(path: Path) -> dict:
    """Parse a GGUF's header and tensor table (cheap: memory-mapped). Returns a few facts; a file that does not parse
    (bad magic, truncated, ...) raises GraftError("cannot read GGUF file X: ...")."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        import gguf

        reader = gguf.GGUFReader(str(path))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        if end > size:
            raise ValueError(f"truncated: tensor data needs {end} bytes, file has {size}")
        field = reader.get_field("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field is not None else None
        has_template = reader.get_field("tokenizer.chat_template") is not None
        return {"architecture": arch, "tensors": len(reader.tensors), "has_chat_template": has_template}
    except GraftError:
        raise
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError/IndexError/... on damaged files
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GraftError(f"cannot read GGUF file {path}: {msg}") from e


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Dequantise a GGUF into a float32 Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer
    with its chat template) and check that the result reloads with identical logits. Returns facts for the
    manifest. Any failure is a GraftError naming the file."""
    import torch  # lazy: the catalog stays light until a conversion runs (`graft models list` needs no torch)

    gguf_path = Path(gguf_path)
    with _quiet_loader():
        t0 = time.perf_counter()
        model, tok = _read_gguf(gguf_path)
        load_s = time.perf_counter() - t0
        fresh = _plain_copy(model, gguf_path.name)
        params = sum(p.numel() for p in fresh.parameters())
        vocab = int(fresh.config.vocab_size)
        probe = torch.tensor([[tok.bos_token_id or 0] + [(100 + 37 * i) % vocab for i in range(7)]])
        with torch.no_grad():
            ref = model(probe).logits
        chat_source = "gguf"
        if not getattr(tok, "chat_template", None):
            tok.chat_template = CHATML_TEMPLATE
            chat_source = "chatml-fallback"
        out_dir.mkdir(parents=True, exist_ok=True)
        fresh.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        four_bit = _write_q4(gguf_path, out_dir, fresh)
        del model, fresh
        gc.collect()
        facts = _check_reload(out_dir, gguf_path.name, probe, ref)
    order = ("architecture", "model_type", "parameters", "vocab_size", "dtype", "chat_template",
             "verified_logits_max_abs_diff", "gguf_load_seconds", "q4_weights", "transformers_version",
             "torch_version")
    facts |= {"parameters": int(params), "chat_template": chat_source, "gguf_load_seconds": round(load_s, 2),
              "q4_weights": four_bit}
    return {key: facts[key] for key in order}  # the manifest's order, as it always was


def _write_q4(gguf_path: Path, out_dir: Path, model: Any) -> int:
    """The GGUF's quantized linear weights kept beside the conversion (graft_cli/catalog/q4.py); how many."""
    weights = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    try:
        return write_q4(gguf_path, out_dir, model.config, weights)
    except Exception as e:  # noqa: BLE001 - a block layout this reader does not know is a damaged file to graft
        raise GraftError(f"cannot convert {gguf_path.name}: {str(e).splitlines()[0] if str(e) else e}") from e


@contextlib.contextmanager
def _quiet_loader() -> Iterator[None]:
    """Our own spinner covers conversion; transformers' tqdm bars (its GGUF loader uses tqdm directly) would
    interleave with it, so they are off for the duration, and as they were after."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils  # lazy: transformers only for a conversion
    from transformers.utils import logging as hf_logging  # lazy: as above

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _read_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """The GGUF's model (dequantised to float32) and tokenizer, as transformers reads them."""
    import torch  # lazy: as in convert_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: as in convert_gguf

    try:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - any loader failure is a damaged or unsupported file
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GraftError(f"cannot read GGUF file {gguf_path}: {msg}") from e
    return model, tok


def _plain_copy(model: Any, name: str) -> Any:
    """A GGUF-loaded model refuses save_pretrained: the same model rebuilt from its config (without the quantization
    config), on the meta device so the float32 weights are shared, not copied."""
    import torch  # lazy: as in convert_gguf
    from transformers import AutoModelForCausalLM  # lazy: as in convert_gguf

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = fresh.load_state_dict(model.state_dict(), strict=False, assign=True)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise GraftError(f"cannot convert {name}: weights do not match the architecture "
                         f"(missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})")
    fresh.tie_weights()
    still_meta = [n for n, p in fresh.named_parameters() if p.is_meta]
    if still_meta:
        raise GraftError(f"cannot convert {name}: no weights for {still_meta[:3]}")
    fresh.generation_config = copy.deepcopy(model.generation_config)
    return fresh


def _check_reload(out_dir: Path, name: str, probe: Any, ref: Any) -> dict:
    """The saved directory must load on its own, with no missing weights and the same logits; the facts of it."""
    import torch  # lazy: as in convert_gguf
    import transformers  # lazy: as in convert_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: as in convert_gguf

    try:
        reloaded, info = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, output_loading_info=True)
        tok = AutoTokenizer.from_pretrained(out_dir)
    except Exception as e:  # noqa: BLE001
        raise GraftError(f"converted {name} does not reload: {e}") from e
    if info.get("missing_keys"):
        raise GraftError(f"converted {name} reloads without {sorted(info['missing_keys'])[:3]}")
    if not getattr(tok, "chat_template", None):
        raise GraftError(f"converted {name}: the saved tokenizer lost its chat template")
    with torch.no_grad():
        diff = (reloaded(probe).logits - ref).abs().max().item()
    if not diff <= 1e-4:
        raise GraftError(f"converted {name} does not reproduce the GGUF's logits (max diff {diff:g})")
    facts = {
        "architecture": (reloaded.config.architectures or [type(reloaded).__name__])[0],
        "model_type": reloaded.config.model_type,
        "vocab_size": int(reloaded.config.vocab_size),
        "dtype": "float32",
        "verified_logits_max_abs_diff": diff,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
    }
    del reloaded
    gc.collect()
    return facts


def gguf_sha256(path: Path) -> str:
    """sha256 of a local GGUF, remembered in gguf-index.json by (real path, size, mtime) so it is computed once."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index_path = graft_home() / "gguf-index.json"
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    digest = file_sha256(path)
    index[key] = digest
    ensure_dir(index_path.parent)
    with contextlib.suppress(OSError):  # best effort: the hash is paid again next time
        write_text_atomic(index_path, json.dumps(index, indent=1))
    return digest
