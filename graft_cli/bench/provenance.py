"""Where a run's figures come from: checksums of the model, the draft and the questions, the code's commit, the
package versions and the machine. results.json records them; the fingerprints of a resumed run compare them."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from graft_cli.bench.datasets import REPO_ROOT
from graft_cli.bench.models import Models
from graft_cli.bench.options import BenchOptions
from graft_cli.core.cpu_units import cpu_units
from graft_cli.bench.workload import Workload
from graft_cli.catalog.checksums import model_checksum
from graft_cli.heads import resolve_head
from graft_cli.heads.head import WEIGHT_FILES
from graft_cli.runtime import token_ranking


@dataclass
class Provenance:
    model_checksum: str
    draft_checksum: str | None  # a model's checksum, an EAGLE-3 head's weights' sha256, or a plugin's spec
    token_ranking_sha: str | None  # the vocabulary ranking a draft model's drafting follows, when there is one
    dataset_sha: str
    commit: str | None  # HEAD, "-dirty" when tracked files changed; None outside a git checkout
    environment: dict  # versions and device: see :func:`environment`


def gather(opts: BenchOptions, workload: Workload, models: Models) -> Provenance:
    checksum = model_checksum(models.target.path)
    draft_checksum = model_checksum(models.draft.path) if models.draft else opts.draft  # a plugin's: its spec
    # a draft model's drafting follows the target's vocabulary ranking: another ranking, other trees
    ranking = token_ranking.ranking_path(models.target.tokenizer) if models.draft else None
    ranking_sha = file_sha256(ranking) if ranking is not None and ranking.is_file() else None
    if workload.draft_kind == "eagle3":
        root = resolve_head(workload.draft_spec)
        weights = next((root / name for name in WEIGHT_FILES if (root / name).is_file()), None)
        draft_checksum = file_sha256(weights) if weights is not None else None
    return Provenance(model_checksum=checksum, draft_checksum=draft_checksum, token_ranking_sha=ranking_sha,
                      dataset_sha=file_sha256(workload.dataset), commit=git_commit(),
                      environment=environment(models.device))


def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def environment(device: str) -> dict:
    """Package versions and the device, for results.json."""
    versions = {"python": platform.python_version()}
    for pkg in ("graft-sd", "torch", "transformers", "numpy", "matplotlib", "rich", "typer"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    info = {"device": device, "platform": platform.platform(), "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device).index or 0)
    else:
        info["cpu"] = _cpu_name()
        info["cpu_units"] = cpu_units().summary()  # the figures depend on them: bf16 pays only with AMX/AVX512-BF16
    return {"versions": versions, "device": info}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
