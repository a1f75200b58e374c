"""The n-gram store: the corpus's n-token contexts with their counted next tokens, searchable by similarity.

A context that never occurred verbatim still finds *near* contexts: every stored context is embedded
(datastores/ngram_vectors.py) and indexed with FAISS (exact inner-product search when small, IVF or HNSW when
large, on the GPU when faiss-gpu is installed and the device is CUDA). A lookup takes the exact context when it
exists (similarity 1) plus the nearest neighbours above ``min_sim``, ranks their next tokens by similarity x
count, then extends the best paths with exact n-gram lookups (from the best hit's context: the exact one, else
the nearest neighbour's), best first, until the budget is spent.

Files of one shard: the table (datastores/ngram_table.py: ``ctx.u32``, ``next.u32``, ``count.u32``,
``total.u32``, ``hash.u64``), ``embed.f32`` ``[V, dim]`` the projected token embeddings queries are embedded
with, and ``index.faiss`` the vector index (vector ``i`` is row ``i`` of the table).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import numpy as np

from datastores.errors import DatastoreError
from datastores.ngram_params import QUERY_DEFAULTS, check_params
from datastores.ngram_table import build_rows, count_ngrams, hash_context, sort_by_hash
from datastores.ngram_vectors import context_vectors, embed_contexts, embedding_table
from datastores.shard_writer import IndexFiles, Progress
from datastores.suffix_array import Continuation, Lookup
from datastores.tokenize import SEP_INT

NGRAM_FILES = ["ctx.u32", "next.u32", "count.u32", "total.u32", "hash.u64", "embed.f32", "index.faiss"]
ADD_CHUNK = 262144  # vectors added to the index at a time (one progress step each)


def import_faiss() -> ModuleType:
    """FAISS from either wheel: faiss-cpu (``pip install 'graft-sd[cpu]'``) or faiss-gpu-cu12 (``[cuda]``), which
    both provide the module ``faiss`` and so must never be installed together."""
    try:
        import faiss
    except ImportError:
        raise DatastoreError("n-gram datastores need FAISS: pip install 'graft-sd[cpu]' (faiss-cpu), or "
                             "'graft-sd[cuda]' (faiss-gpu-cu12) on a CUDA machine") from None
    return faiss


# --- building -------------------------------------------------------------------------------------------------


def write_ngram_files(
    directory: Path, tokens_path: Path, vocab_size: int, model_dir: Path, params: dict[str, Any],
    progress: Progress | None = None,
) -> IndexFiles:
    """Build the n-gram table and its FAISS index from ``tokens_path`` into ``directory``."""
    faiss = import_faiss()
    p = check_params(params)
    t0 = time.perf_counter()
    # nested calls: the tokens and the raw counts are freed as soon as the next phase no longer needs them
    rows = build_rows(count_ngrams(np.fromfile(tokens_path, dtype=np.uint32), p["n"], vocab_size),
                      min_count=p["min_count"], max_contexts=p["max_contexts"], top_k=p["top_k"])
    table = sort_by_hash(rows)
    del rows
    t_table = time.perf_counter()
    embedding = embedding_table(model_dir, vocab_size, p["dim"])
    vectors = context_vectors(table.ctx, embedding, p["decay"])
    t_embed = time.perf_counter()
    index = build_faiss_index(faiss, vectors, p, progress)
    del vectors
    t_index = time.perf_counter()
    table.write(directory)
    embedding.astype(np.float32).tofile(directory / "embed.f32")
    faiss.write_index(index.index, str(directory / "index.faiss"))
    info = {
        "contexts": int(table.ctx.shape[0]),
        "vocab_size": int(vocab_size),
        "dim": int(embedding.shape[1]),
        "faiss": index.kind,
        "nlist": index.nlist,
        "table_s": round(t_table - t0, 3),
        "embed_s": round(t_embed - t_table, 3),
        "faiss_s": round(t_index - t_embed, 3),
    }
    return IndexFiles(info, list(NGRAM_FILES))


@dataclass
class FaissIndex:
    """A FAISS index as built, with what the manifest says of it."""

    index: Any
    kind: str  # flat, ivf or hnsw
    nlist: int = 0  # IVF lists (0 for the others)


def build_faiss_index(
    faiss: ModuleType, vectors: np.ndarray, params: dict[str, Any], progress: Progress | None = None
) -> FaissIndex:
    """All ``vectors`` in a FAISS index of the kind ``params["index"]`` names (``auto``: flat up to
    ``flat_max`` vectors, IVF beyond)."""
    rows = vectors.shape[0]
    kind = params["index"]
    if kind == "auto":
        kind = "flat" if rows <= params["flat_max"] else "ivf"
    built = _empty_index(faiss, kind, vectors)
    for lo in range(0, rows, ADD_CHUNK):
        built.index.add(vectors[lo : lo + ADD_CHUNK])
        if progress is not None:
            progress.advance("index", min(ADD_CHUNK, rows - lo), total=rows)
    return built


def _empty_index(faiss: ModuleType, kind: str, vectors: np.ndarray) -> FaissIndex:
    """An index of ``kind`` for vectors like ``vectors``, trained on a sample of them where it needs training."""
    rows, dim = vectors.shape
    if kind == "flat":
        return FaissIndex(faiss.IndexFlatIP(dim), kind)
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 64
        return FaissIndex(index, kind)
    nlist = int(min(65536, max(16, round(math.sqrt(rows)))))
    nlist = min(nlist, max(1, rows // 39))
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(0)
    sample = vectors[rng.choice(rows, size=min(rows, 40 * nlist), replace=False)]
    index.cp.niter = 10  # coarse lists need no more: they only route the search
    index.train(sample)
    index.quantizer_trains_alone = 0
    return FaissIndex(index, kind, nlist)


# --- queries --------------------------------------------------------------------------------------------------


def _gpu_of(device: str) -> int:
    """The GPU number of a torch device name (``cuda`` is GPU 0, ``cuda:1`` GPU 1)."""
    _, _, number = device.partition(":")
    return int(number) if number.isdigit() else 0


class _NgramShard:
    """One shard of an n-gram store, its table memory-mapped and its FAISS index loaded (on the GPU where asked
    and possible)."""

    def __init__(self, directory: Path, manifest: dict, device: str = "cpu") -> None:
        faiss = import_faiss()

        info, params = manifest["index"], manifest["params"]
        self.n, self.k = int(params["n"]), int(params["top_k"])
        self.decay = float(params["decay"])
        rows, dim, vocab = int(info["contexts"]), int(info["dim"]), int(info["vocab_size"])

        import mmap

        self._maps = []

        def mm(name: str, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
            # plain ndarrays over read-only maps: no np.memmap overhead on every small read
            count = int(np.prod(shape))
            if count == 0:
                return np.empty(shape, dtype=dtype)
            with open(directory / name, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps.append(m)
            return np.frombuffer(m, dtype=dtype, count=count).reshape(shape)

        self.ctx = mm("ctx.u32", np.uint32, (rows, self.n))
        self.next = mm("next.u32", np.uint32, (rows, self.k))
        self.count = mm("count.u32", np.uint32, (rows, self.k))
        self.total = mm("total.u32", np.uint32, (rows,))
        self.hash = np.fromfile(directory / "hash.u64", dtype=np.uint64)
        self.table = np.fromfile(directory / "embed.f32", dtype=np.float32).reshape(vocab, dim)
        try:
            self.index = faiss.read_index(str(directory / "index.faiss"), faiss.IO_FLAG_MMAP)
        except RuntimeError:
            try:
                self.index = faiss.read_index(str(directory / "index.faiss"))
            except RuntimeError as e:
                raise DatastoreError(f"datastore shard {directory}: unreadable FAISS index ({str(e).splitlines()[0]})") from e
        if self.index.ntotal != rows or self.index.d != dim:
            raise DatastoreError(f"datastore shard {directory}: the FAISS index does not match the table (rebuild it)")
        nprobe = int(params.get("nprobe", 8))
        try:
            faiss.extract_index_ivf(self.index).nprobe = nprobe
        except (RuntimeError, AttributeError):
            if hasattr(self.index, "hnsw"):
                self.index.hnsw.efSearch = max(16, 4 * nprobe)
        if device.startswith("cuda") and hasattr(faiss, "StandardGpuResources"):  # faiss-gpu: the model's GPU
            try:
                if faiss.get_num_gpus() > _gpu_of(device):
                    self._res = faiss.StandardGpuResources()
                    self.index = faiss.index_cpu_to_gpu(self._res, _gpu_of(device), self.index)
            except (RuntimeError, AttributeError):
                pass  # stay on the CPU

    def exact(self, ctx: Sequence[int]) -> int:
        """Row of context ``ctx`` (exactly ``n`` tokens), or -1."""
        h = np.uint64(hash_context(ctx))
        i = int(np.searchsorted(self.hash, h))
        want = [int(t) for t in ctx]
        while i < self.hash.size and self.hash[i] == h:
            if self.ctx[i].tolist() == want:
                return i
            i += 1
        return -1

    def embed(self, ctx: Sequence[int]) -> np.ndarray | None:
        if any(not 0 <= int(t) < self.table.shape[0] for t in ctx):
            return None
        return embed_contexts(np.asarray([ctx], dtype=np.int64), self.table, self.decay)

    def continuations(self, row: int) -> tuple[list[int], list[int], int]:
        nx, ct = self.next[row].tolist(), self.count[row].tolist()
        live = [i for i, t in enumerate(nx) if t != SEP_INT]
        return [nx[i] for i in live], [ct[i] for i in live], int(self.total[row])


class NgramIndex:
    """The shards of one n-gram store, queried together."""

    kind = "ngram"

    def __init__(self, shards: Sequence[tuple[Path, dict]], device: str = "cpu") -> None:
        self.shards = [_NgramShard(d, m, device) for d, m in shards]
        self.n = self.shards[0].n

    def close(self) -> None:
        self.shards = []

    def _exact_distribution(self, ctx: Sequence[int]) -> dict[int, tuple[int, int]]:
        """``{token: (count, total)}`` summed over the shards where ``ctx`` occurs (empty when nowhere)."""
        out: dict[int, list[int]] = {}
        total = 0
        for shard in self.shards:
            row = shard.exact(ctx)
            if row < 0:
                continue
            toks, cnts, tot = shard.continuations(row)
            total += tot
            for t, c in zip(toks, cnts):
                out.setdefault(t, [0])[0] += c
        return {t: (c[0], total) for t, c in out.items()}

    def lookup(
        self,
        context: Sequence[int],
        *,
        neighbours: int = QUERY_DEFAULTS["neighbours"],
        min_sim: float = QUERY_DEFAULTS["min_sim"],
        depth: int = QUERY_DEFAULTS["depth"],
        budget: int = QUERY_DEFAULTS["budget"],
        **_: Any,
    ) -> Lookup:
        n = self.n
        if len(context) < n or budget <= 0:
            return Lookup()
        hits, exact = self._hits([int(t) for t in context[-n:]], neighbours, min_sim)
        if not hits:
            return Lookup()
        first, neigh = self._first_tokens(hits)
        # deeper levels continue from the best hit's context: the exact one, else the nearest neighbour's
        best_si, best_row = max(hits, key=lambda key: hits[key])
        nodes = self._grow(first, [int(t) for t in self.shards[best_si].ctx[best_row]], depth, budget)
        total = int(sum(self.shards[si].total[row] for si, row in hits))
        return Lookup(match_len=n if exact else 0, occurrences=total, counted=total, nodes=nodes, neighbours=neigh)

    def _hits(self, ctx: list[int], neighbours: int, min_sim: float) -> tuple[dict[tuple[int, int], float], bool]:
        """Level 1: the exact context (similarity 1) and its nearest neighbours, as ``{(shard, row): similarity}``;
        and whether the exact context was found."""
        hits: dict[tuple[int, int], float] = {}
        exact = False
        for si, shard in enumerate(self.shards):
            row = shard.exact(ctx)
            if row >= 0:
                hits[(si, row)] = 1.0
                exact = True
            if neighbours > 0:
                q = shard.embed(ctx)
                if q is None:
                    continue
                sims, ids = shard.index.search(q, neighbours)
                for s, i in zip(sims[0].tolist(), ids[0].tolist()):
                    if i >= 0 and s >= min_sim and (si, i) not in hits:
                        hits[(si, i)] = min(float(s), 1.0)
        return hits, exact

    def _first_tokens(self, hits: dict[tuple[int, int], float]) -> tuple[list[tuple[float, int, int]], list]:
        """The hits' continuations as first tokens ``(score, token, count)``: counts weighted by the hit's
        similarity, scaled by the best similarity; and each hit's context with its similarity."""
        weighted: dict[int, float] = {}
        raw: dict[int, int] = {}
        denom = 0.0
        neigh = []
        for (si, row), sim in sorted(hits.items(), key=lambda kv: -kv[1]):
            shard = self.shards[si]
            toks, cnts, tot = shard.continuations(row)
            denom += sim * tot
            neigh.append((sim, [int(t) for t in shard.ctx[row]]))
            for t, c in zip(toks, cnts):
                weighted[t] = weighted.get(t, 0.0) + sim * c
                raw[t] = raw.get(t, 0) + c
        conf = max(hits.values())
        return [(conf * w / denom if denom > 0 else 0.0, t, raw[t]) for t, w in weighted.items()], neigh

    def _grow(self, first: list[tuple[float, int, int]], base: list[int], depth: int,
              budget: int) -> list[Continuation]:
        """Best first from ``first``: pop the best pending node, emit it, push its children (the exact n-gram
        continuations of ``base`` and its path), until ``budget`` nodes."""
        n = self.n
        nodes: list[Continuation] = []
        heap: list[tuple[float, int, int, int, int, tuple[int, ...]]] = []
        serial = 0
        for score, t, count in first:
            heapq.heappush(heap, (-score, serial, t, -1, count, ()))
            serial += 1
        while heap and len(nodes) < budget:
            neg, _, tok, parent, count, path = heapq.heappop(heap)
            idx = len(nodes)
            path = path + (tok,)
            nodes.append(Continuation(tok, parent, len(path), int(count), -neg))
            if len(path) >= depth:
                continue
            dist = self._exact_distribution((base + list(path))[-n:])
            for t, (c, tot) in dist.items():
                heapq.heappush(heap, (neg * c / tot, serial, t, idx, c, path))
                serial += 1
        return nodes
