"""From what a user types after ``--model`` to a Hugging Face dir (pulling, converting or downloading on first use),
and the listing behind ``graft models list`` / ``info``.

A spec is tried as, in this order: a catalog name; an existing local path (a model directory or a .gguf file);
the name of an earlier GGUF conversion (``gguf-<sha12>``); a Hugging Face hub id ``ORG/NAME[@REVISION]``
(``hub.py``). So a directory named like a catalog model is written ``./name``, and a local ``ORG/NAME`` directory
wins over the hub id it spells."""

from __future__ import annotations

from pathlib import Path

from graft_cli.catalog.checksums import check_hf_dir, check_weights, model_checksum
from graft_cli.catalog.entries import CATALOG, DEFAULT_MODEL
from graft_cli.catalog.gguf import gguf_sha256
from graft_cli.catalog.home import eprint, installed_models, is_pulled, mb, models_dir, read_manifest
from graft_cli.catalog.hub import parse_hub_id, snapshot
from graft_cli.catalog.install import convert_local_gguf, pull
from graft_cli.core import GraftError

def _checked(name: str) -> Path:
    """A pulled dir, after a check of its weights against the checksums recorded when it was pulled (a damaged
    one says how to repair it)."""
    d = models_dir() / name
    try:
        check_hf_dir(d)
        check_weights(d)
        return d
    except GraftError as e:
        hint = f"graft models pull --force {name}" if name in CATALOG else f"graft models rm {name}"
        raise GraftError(f"{e} (run `{hint}`)") from None


def resolve_model(spec: str, *, pull_if_missing: bool = True, force: bool = False) -> Path:
    """Turn a model spec into a Hugging Face directory (see the module docstring). A catalog name that is not
    pulled yet is pulled first, and a hub id not in the hub cache downloaded first (each after saying so on
    stderr), unless ``pull_if_missing`` is false. ``force``: a hub id's files are downloaded again."""
    spec = str(spec).strip()
    if not spec:
        raise GraftError("empty model name")
    if spec in CATALOG:
        if is_pulled(spec):
            return _checked(spec)
        if not pull_if_missing:
            raise GraftError(f"model '{spec}' is not pulled yet: run `graft models pull {spec}`")
        eprint(f"graft: pulling {spec} ({mb(CATALOG[spec].gguf_bytes)}) on first use ...")
        return pull(spec)

    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            if (path / "config.json").is_file():
                return check_hf_dir(path)
            raise GraftError(f"{path} is a directory without config.json (not a Hugging Face model directory)")
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise GraftError(f"cannot read {path}: {e.strerror or e}") from e
        if path.suffix.lower() == ".gguf" or magic == b"GGUF":
            if not pull_if_missing:
                name = f"gguf-{gguf_sha256(path)[:12]}"
                if is_pulled(name):
                    return models_dir() / name
                raise GraftError(f"{path} has not been converted yet")
            return convert_local_gguf(path)
        raise GraftError(f"{path} is neither a .gguf file nor a Hugging Face model directory")

    if "/" not in spec and is_pulled(spec):  # an earlier conversion, by its gguf-<sha12> name
        return _checked(spec)
    hub_id = parse_hub_id(spec)
    if hub_id is not None:
        return check_hf_dir(snapshot(hub_id, "model", download=pull_if_missing, force=force))
    if "/" in spec or spec.endswith(".gguf") or spec.startswith((".", "~")):
        raise GraftError(f"no such file or directory: {spec}")
    raise GraftError(f"unknown model '{spec}': not a catalog name ({', '.join(CATALOG)}), a path "
                     "nor a Hugging Face id (ORG/NAME)")


def list_models() -> list[dict]:
    """One row per catalog model (pulled or not) and per other converted dir under models/; ``q4_weights``: the
    linear weights ``--dtype q4`` runs as the GGUF stores them (None: pulled before graft kept them, or not pulled)."""
    rows = []
    for name, e in CATALOG.items():
        d = models_dir() / name
        manifest = read_manifest(d) if is_pulled(name) else None
        rows.append(
            {
                "name": name,
                "default": name == DEFAULT_MODEL,
                "pulled": manifest is not None,
                "gguf_bytes": e.gguf_bytes,
                "download_bytes": e.download_bytes,
                "dir_bytes": manifest.get("dir_bytes") if manifest else None,
                "q4_weights": manifest.get("q4_weights") if manifest else None,
                "path": str(d) if manifest else None,
                "description": e.description,
            }
        )
    for d in installed_models():
        if d.name in CATALOG:
            continue
        m = read_manifest(d) or {}
        rows.append(
            {
                "name": d.name,
                "default": False,
                "pulled": True,
                "gguf_bytes": m.get("gguf_bytes"),
                "download_bytes": None,
                "dir_bytes": m.get("dir_bytes"),
                "q4_weights": m.get("q4_weights"),
                "path": str(d),
                "description": m.get("description", ""),
            }
        )
    return rows


def model_info(spec: str) -> dict:
    """The manifest of a pulled model (catalog name, gguf-* name or converted dir path); for a catalog model that
    is not pulled, its catalog facts with ``pulled: false``."""
    if spec in CATALOG:
        d = models_dir() / spec
        m = read_manifest(d) if is_pulled(spec) else None
        if m is None:
            e = CATALOG[spec]
            return {
                "name": spec,
                "pulled": False,
                "default": spec == DEFAULT_MODEL,
                "description": e.description,
                "source": {"packages": list(e.packages), "member": e.member},
                "gguf_file": e.gguf_file,
                "gguf_sha256": e.sha256,
                "gguf_bytes": e.gguf_bytes,
                "download_bytes": e.download_bytes,
            }
        return {"pulled": True, "path": str(d), **m}
    d = models_dir() / spec if "/" not in spec else Path(spec).expanduser()
    m = read_manifest(d)
    hub_id = parse_hub_id(spec)
    if m is None and hub_id is not None and not d.exists():  # a hub id: what the hub cache holds, never fetched
        p = snapshot(hub_id, "model", download=False)
        return {"name": str(hub_id), "pulled": True, "path": str(p), "kind": "hugging-face-hub", "commit": p.name,
                "sha256": model_checksum(p)}
    if m is None:
        p = Path(spec).expanduser()
        if p.is_dir() and (p / "config.json").is_file():
            check_hf_dir(p)
            return {"name": p.name, "pulled": True, "path": str(p), "kind": "hf-dir", "sha256": model_checksum(p)}
        raise GraftError(f"unknown model '{spec}': not a catalog name ({', '.join(CATALOG)}) nor a converted model")
    return {"pulled": True, "path": str(d), **m}
