"""Models and heads named by their Hugging Face hub id, ``ORG/NAME[@REVISION]``, kept in huggingface_hub's own cache.

The cache is huggingface_hub's (``HF_HOME``, ``HF_HUB_CACHE``), searched and filled by its own code, so a model
another tool already downloaded is found here and one downloaded here is found by them; ``HF_TOKEN`` reaches
private and gated repositories the same way. A snapshot already in the cache is used as it is, without a request:
a cached model loads with the network off. A missing one is downloaded once, after one line on stderr that says
what and how much, and only the files graft reads: the config, the tokenizer and the weights in one format
(safetensors where the repository has them). ``HF_HUB_OFFLINE=1`` turns the download into a one-line error.

Nothing here imports torch; huggingface_hub itself is imported only when an id is looked up.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from graft_cli.catalog.home import eprint, mb
from graft_cli.core import GraftError

# ORG/NAME as the hub spells repository ids, then an optional @REVISION: a branch, a tag or a commit hash (full or
# a unique prefix of a cached one). A revision may hold '/' (refs/pr/1), never '@' or whitespace.
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+)(?:@(?P<revision>[^\s@]+))?")
SHORT_COMMIT = re.compile(r"[0-9a-f]{7,39}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
CONFIGS = ("config.json", "generation_config.json")
TOKENIZER = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
             "chat_template.jinja", "chat_template.json", "*.tiktoken")
# the weights, in the order graft prefers them; a sharded checkpoint is its index and the shards it names
WEIGHTS = (("model.safetensors",), ("model.safetensors.index.json", "model-*-of-*.safetensors"), ("*.safetensors",),
           ("pytorch_model.bin",), ("pytorch_model.bin.index.json", "pytorch_model-*-of-*.bin"))


@dataclass(frozen=True)
class HubId:
    repo: str  # ORG/NAME
    revision: str | None = None  # None: the default branch

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(spec: str) -> HubId | None:
    """``ORG/NAME[@REVISION]`` to a HubId; None for anything else (a path, a file name, a catalog name)."""
    match = HUB_ID.fullmatch(str(spec).strip())
    if match is None or match["repo"].lower().endswith(".gguf"):
        return None
    return HubId(match["repo"], match["revision"])


def hub_cache() -> Path:
    """Where huggingface_hub keeps its cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``), as it computed it."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub read it at import, or as the environment says now: a user who turned
    the network off is never sent to it."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or now.strip().upper() in {"1", "ON", "YES", "TRUE"}


def is_hub_snapshot(path: Path) -> bool:
    """Whether ``path`` is a snapshot directory of the hub cache (``models--ORG--NAME/snapshots/<commit>``)."""
    path = Path(path)
    return path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--")


def blob_sha256(path: Path) -> str | None:
    """The SHA-256 of a snapshot file, read off the name of the blob it links to: large files are stored under
    the SHA-256 the hub published for them. None for a file that is not such a link."""
    path = Path(path)
    if not path.is_symlink():
        return None
    target = path.resolve()
    return target.name if target.parent.name == "blobs" and SHA256_HEX.fullmatch(target.name) else None


def cached_snapshot(hub: HubId) -> Path | None:
    """The cached snapshot of ``hub`` at its revision, found by huggingface_hub's own lookup (a branch or tag
    through ``refs/``, a commit hash as ``snapshots/<commit>``) or, for a short commit hash, the one snapshot it
    starts; None where the cache has no config.json for it."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(hub.repo, "config.json", revision=hub.revision)
    except ValueError as e:  # an id or revision huggingface_hub refuses
        raise GraftError(f"'{hub}' is not a valid Hugging Face id: {_first_line(e)}") from None
    if isinstance(found, str):
        return Path(found).parent
    if hub.revision and SHORT_COMMIT.fullmatch(hub.revision):
        snapshots = _snapshots(hub)
        matches = sorted(snapshots.glob(f"{hub.revision}*")) if snapshots.is_dir() else []
        if len(matches) == 1 and (matches[0] / "config.json").is_file():
            return matches[0]
    return None


def _snapshots(hub: HubId) -> Path:
    """The folder of ``hub``'s snapshots in the cache, named as huggingface_hub names it."""
    from huggingface_hub.file_download import repo_folder_name

    return hub_cache() / repo_folder_name(repo_id=hub.repo, repo_type="model") / "snapshots"


def missing_files(path: Path) -> list[str]:
    """What a snapshot lacks before graft can read it: config.json and weights (every shard an index names)."""
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            try:
                shards = set(json.loads((path / index).read_text(encoding="utf-8"))["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return [*missing, f"a readable {index}"]
            return missing + sorted(s for s in shards if not (path / s).is_file())
    if not (path / "pytorch_model.bin").is_file() and not any(p.is_file() for p in path.glob("*.safetensors")):
        missing.append("weights (*.safetensors or pytorch_model.bin)")
    return missing


def wanted_files(names: list[str]) -> list[str]:
    """The files of a repository graft downloads: configs, tokenizer files and the weights in the first format
    of WEIGHTS the repository has; nothing in subfolders (other frameworks' weights, ONNX, originals)."""
    top = [n for n in names if "/" not in n]
    chosen = [n for n in top if n in CONFIGS or any(fnmatch.fnmatch(n, p) for p in TOKENIZER)]
    for patterns in WEIGHTS:
        if any(fnmatch.fnmatch(n, patterns[0]) for n in top):
            return chosen + [n for n in top if any(fnmatch.fnmatch(n, p) for p in patterns)]
    return chosen


def snapshot(hub: HubId, what: str = "model", *, download: bool = True, force: bool = False) -> Path:
    """``hub``'s snapshot directory: the cached one when it is whole (no request at all), else downloaded unless
    the network is off (``HF_HUB_OFFLINE``) or ``download`` is false. ``force`` downloads the files again."""
    cached = None if force else cached_snapshot(hub)
    if cached is not None and not missing_files(cached):
        return cached
    where = f"{what} {hub}"
    state = (f"is only partly in the Hugging Face cache ({cached} lacks {', '.join(missing_files(cached))})"
             if cached is not None else f"is not in the Hugging Face cache ({hub_cache()})")
    if offline():
        raise GraftError(f"{where} {state} and HF_HUB_OFFLINE is set: unset it to download it")
    if not download:
        raise GraftError(f"{where} {state}: run `graft models pull {hub}`")
    path = _download(hub, where, force)
    lacking = missing_files(path)
    if lacking:
        raise GraftError(f"{where}: the repository has no {', '.join(lacking)} graft can read")
    return path


def _download(hub: HubId, where: str, force: bool) -> Path:
    """The files graft reads, downloaded by huggingface_hub into its cache (each file written to a temporary name
    and renamed: an interrupted download leaves no half file), after one line saying how many bytes."""
    from huggingface_hub import HfApi, snapshot_download

    try:
        info = HfApi().model_info(hub.repo, revision=hub.revision, files_metadata=True)
        sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
        files = wanted_files(list(sizes))
        if not any(n.endswith((".safetensors", ".bin")) for n in files):
            raise GraftError(f"{where}: the repository has no weights graft reads (*.safetensors or pytorch_model.bin)")
        have = _snapshots(hub) / str(info.sha)
        fetch = [n for n in files if force or not (have / n).is_file()]
        total = sum(sizes[n] for n in fetch)
        eprint(f"graft: downloading {hub.repo}@{hub.revision or 'main'} (commit {str(info.sha)[:12]}): "
               f"{len(fetch)} files, {mb(total)} ({total:,} bytes) into {hub_cache()}")
        return Path(snapshot_download(hub.repo, revision=hub.revision, allow_patterns=files, force_download=force))
    except GraftError:
        raise
    except Exception as e:  # whatever the hub, the network or the disk said: one line
        raise _hub_error(e, hub, where) from None


def _hub_error(e: Exception, hub: HubId, where: str) -> GraftError:
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        return GraftError(f"{where} is gated: accept its terms on huggingface.co and set HF_TOKEN")
    if isinstance(e, errors.RepositoryNotFoundError):
        return GraftError(f"{where}: no such repository on the Hugging Face hub (a private one needs HF_TOKEN)")
    if isinstance(e, errors.RevisionNotFoundError):
        return GraftError(f"{where}: the repository has no revision '{hub.revision}'")
    if isinstance(e, errors.HFValidationError):
        return GraftError(f"'{hub}' is not a valid Hugging Face id: {_first_line(e)}")
    if isinstance(e, errors.LocalEntryNotFoundError):  # the hub did not answer and the cache has nothing
        return GraftError(f"{where}: cannot reach the Hugging Face hub and it is not in its cache ({hub_cache()})")
    if isinstance(e, errors.HfHubHTTPError):
        return GraftError(f"{where}: the Hugging Face hub answered {_first_line(e)}")
    if isinstance(e, OSError) and not isinstance(e, ConnectionError):
        return GraftError(f"{where}: cannot download into {hub_cache()}: {_first_line(e)}")
    return GraftError(f"{where}: cannot reach the Hugging Face hub ({type(e).__name__}: {_first_line(e)})")


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
