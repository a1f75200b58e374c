"""The n-gram store: the corpus's n-token contexts with their counted next tokens, searchable by similarity.

A context that never occurred verbatim still finds *near* contexts: every stored context is embedded from the
model's input-embedding rows of its ``n`` tokens (projected to ``dim`` whitened dimensions by PCA over the
embedding table, weighted by position -- the last token counts most, each earlier one ``decay`` times less --
and L2-normalised) and indexed with FAISS (exact inner-product search when small, IVF or HNSW when large, on
the GPU when faiss-gpu is installed and the device is CUDA). A lookup takes the exact context when it exists
(similarity 1) plus the nearest neighbours above ``min_sim``, ranks their next tokens by similarity x count,
then extends the best paths with exact n-gram lookups (from the best hit's context: the exact one, else the
nearest neighbour's), best first, until the budget is spent.

Files of one shard (rows ordered by context hash, so exact lookups are a binary search):

``ctx.u32`` ``[N, n]`` contexts; ``next.u32`` / ``count.u32`` ``[N, top_k]`` best next tokens (SEP-padded) and
their counts; ``total.u32`` ``[N]`` all next-token occurrences of the context; ``hash.u64`` ``[N]`` sorted
context hashes; ``embed.f32`` ``[V, dim]`` the projected token embeddings queries are embedded with;
``index.faiss`` the vector index (vector ``i`` is row ``i``).
"""

from __future__ import annotations

import heapq
import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from datastores.errors import DatastoreError
from datastores.suffix_array import Continuation, Lookup
from datastores.tokenize import SEP, SEP_INT

BUILD_DEFAULTS: dict[str, Any] = {
    "n": 3,  # context length
    "top_k": 8,  # next tokens kept per context
    "min_count": 2,  # contexts seen fewer times are not stored
    "max_contexts": 1_000_000,  # the most frequent contexts kept
    "dim": 64,  # embedding dimensions after PCA
    "decay": 0.7,  # weight ratio between a position and the next one
    "index": "auto",  # auto (flat up to flat_max, else ivf), flat, ivf, hnsw
    "flat_max": 50_000,
    "nprobe": 8,  # IVF lists searched per query (HNSW: efSearch = 4 * nprobe)
}
QUERY_DEFAULTS: dict[str, Any] = {"neighbours": 8, "min_sim": 0.8, "depth": 8, "budget": 64}

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = (1 << 64) - 1


def check_params(params: dict[str, Any]) -> dict[str, Any]:
    out = dict(BUILD_DEFAULTS)
    for key, value in params.items():
        if key not in BUILD_DEFAULTS:
            raise DatastoreError(f"unknown n-gram store parameter {key!r} (known: {', '.join(BUILD_DEFAULTS)})")
        default = BUILD_DEFAULTS[key]
        try:
            out[key] = type(default)(value)
        except (TypeError, ValueError):
            raise DatastoreError(
                f"n-gram store parameter {key} must be a {type(default).__name__}, not {value!r}"
            ) from None
    if not 1 <= out["n"] <= 16:
        raise DatastoreError("n-gram context length n must be between 1 and 16")
    if not 1 <= out["top_k"] <= 64:
        raise DatastoreError("top_k must be between 1 and 64")
    if out["min_count"] < 1 or out["max_contexts"] < 1 or out["dim"] < 2 or out["nprobe"] < 1:
        raise DatastoreError("min_count, max_contexts, nprobe must be at least 1 and dim at least 2")
    if not 0 < out["decay"] <= 1:
        raise DatastoreError("decay must be in (0, 1]")
    if out["index"] not in ("auto", "flat", "ivf", "hnsw"):
        raise DatastoreError("index must be auto, flat, ivf or hnsw")
    return out


def hash_rows(ctx: np.ndarray) -> np.ndarray:
    """64-bit FNV-1a-style hash of each row of token ids (what :func:`hash_context` computes for one)."""
    h = np.full(ctx.shape[0], FNV_OFFSET, dtype=np.uint64)
    prime = np.uint64(FNV_PRIME)
    for j in range(ctx.shape[1]):
        h ^= ctx[:, j].astype(np.uint64)
        h *= prime
    return h


def hash_context(tokens: Sequence[int]) -> int:
    h = FNV_OFFSET
    for t in tokens:
        h = ((h ^ (int(t) & 0xFFFFFFFF)) * FNV_PRIME) & MASK64
    return h


def _position_weights(n: int, decay: float) -> np.ndarray:
    return np.array([decay ** (n - 1 - j) for j in range(n)], dtype=np.float32)


def _orthonormal(y: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning ``y`` (Gram-Schmidt, twice per column for stability)."""
    q = np.array(y, dtype=np.float64)
    for j in range(q.shape[1]):
        for _ in range(2):
            if j:
                q[:, j] -= q[:, :j] @ (q[:, :j].T @ q[:, j])
        norm = np.linalg.norm(q[:, j])
        q[:, j] = q[:, j] / norm if norm > 0 else 0.0
    return q


def top_eigenvectors(cov: np.ndarray, k: int, iters: int = 12) -> np.ndarray:
    """The ``k`` leading eigenvectors of a symmetric PSD matrix by block power iteration and a small
    Rayleigh-Ritz step. Matrix products only, plus one ``(k+16)``-square eigh: a full LAPACK ``eigh`` of a
    576-square matrix takes seconds when OpenBLAS's threads compete with other processes for the cores."""
    d = cov.shape[0]
    p = min(d, k + 16)
    rng = np.random.default_rng(0)
    q = _orthonormal(cov @ rng.standard_normal((d, p)))
    for _ in range(iters):
        q = _orthonormal(cov @ q)
    w, v = np.linalg.eigh(q.T @ cov @ q)
    return (q @ v[:, np.argsort(w)[::-1][:k]]).astype(np.float32)


def project_embeddings(emb: np.ndarray, dim: int) -> np.ndarray:
    """The embedding table centred, projected on its ``dim`` principal directions and whitened (each direction
    scaled to unit variance), as float32 ``[V, dim]``.

    Whitening matters: raw embedding tables are strongly anisotropic (for SmolLM2, two random 3-token contexts
    have cosine ~0.94 after centring alone), so similarity would say little. Whitened, random contexts score
    ~0.45, contexts sharing their last token ~0.78, sharing their last two ~0.93."""
    x = emb.astype(np.float32, copy=True)
    x -= x.mean(axis=0, keepdims=True)
    dim = min(dim, x.shape[1])
    # principal directions from (at most) 16,384 evenly spaced rows: plenty for a stable basis
    step = max(1, x.shape[0] // 16384)
    sample = x[::step]
    w = top_eigenvectors((sample.T @ sample).astype(np.float64), dim)
    out = np.ascontiguousarray(x @ w)
    std = out[::step].std(axis=0)
    out /= np.where(std > 0, std, 1.0).astype(np.float32)
    return out


def embed_contexts(ctx: np.ndarray, table: np.ndarray, decay: float) -> np.ndarray:
    n = ctx.shape[1]
    w = _position_weights(n, decay)
    out = np.zeros((ctx.shape[0], table.shape[1]), dtype=np.float32)
    for j in range(n):
        out += w[j] * table[ctx[:, j]]
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    np.divide(out, norms, out=out, where=norms > 0)
    return out


def _count_ngrams(tokens: np.ndarray, n: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unique ``(context, next)`` pairs, grouped by context: ``(ctx [U, n], next [U], count [U])``."""
    is_sep = tokens == SEP
    cs = np.concatenate([[0], np.cumsum(is_sep, dtype=np.int64)])
    last = tokens.size - n - 1
    if last < 0:
        return np.empty((0, n), np.uint32), np.empty(0, np.uint32), np.empty(0, np.int64)
    starts = np.flatnonzero(cs[n + 1 : n + 2 + last] - cs[: last + 1] == 0)
    if starts.size == 0:
        return np.empty((0, n), np.uint32), np.empty(0, np.uint32), np.empty(0, np.int64)
    bits = max(1, int(vocab_size - 1).bit_length())
    if bits * (n + 1) <= 64:
        key = np.zeros(starts.size, dtype=np.uint64)
        for j in range(n + 1):
            key = (key << np.uint64(bits)) | tokens[starts + j].astype(np.uint64)
        uk, counts = np.unique(key, return_counts=True)
        mask = np.uint64((1 << bits) - 1)
        nxt = (uk & mask).astype(np.uint32)
        ctx = np.empty((uk.size, n), dtype=np.uint32)
        rest = uk >> np.uint64(bits)
        for j in range(n - 1, -1, -1):
            ctx[:, j] = (rest & mask).astype(np.uint32)
            rest >>= np.uint64(bits)
        return ctx, nxt, counts.astype(np.int64)
    grams = np.stack([tokens[starts + j] for j in range(n + 1)], axis=1)
    order = np.lexsort(grams.T[::-1])
    g = grams[order]
    new = np.concatenate([[True], np.any(g[1:] != g[:-1], axis=1)])
    first = np.flatnonzero(new)
    counts = np.diff(np.concatenate([first, [g.shape[0]]]))
    return g[first, :n].copy(), g[first, n].copy(), counts.astype(np.int64)


def write_ngram_files(
    directory: Path, tokens_path: Path, vocab_size: int, model_dir: Path, params: dict[str, Any], progress: Any = None
) -> tuple[dict, list[str]]:
    """Build the n-gram table and its FAISS index from ``tokens_path``; return ``(index info, file names)``."""
    faiss = import_faiss()

    from datastores.embeddings import load_embeddings

    p = check_params(params)
    n, k = p["n"], p["top_k"]
    t0 = time.perf_counter()
    tokens = np.fromfile(tokens_path, dtype=np.uint32)
    ctx_u, nxt_u, cnt_u = _count_ngrams(tokens, n, vocab_size)
    del tokens
    if ctx_u.shape[0] == 0:
        raise DatastoreError(f"the corpus has no {n + 1}-token window inside a document (documents are too short)")
    # group by context
    new = np.concatenate([[True], np.any(ctx_u[1:] != ctx_u[:-1], axis=1)])
    gstart = np.flatnonzero(new)
    gid = np.cumsum(new) - 1
    totals = np.add.reduceat(cnt_u, gstart)
    keep = np.flatnonzero(totals >= p["min_count"])
    if keep.size > p["max_contexts"]:
        keep = keep[np.argpartition(-totals[keep], p["max_contexts"] - 1)[: p["max_contexts"]]]
    if keep.size == 0:
        raise DatastoreError(f"no context occurs at least min_count={p['min_count']} times; lower --min-count")
    keep.sort()
    # best next tokens per kept context
    sel = np.zeros(gstart.size, dtype=bool)
    sel[keep] = True
    rows = np.flatnonzero(sel[gid])
    order = rows[np.lexsort((-cnt_u[rows], gid[rows]))]
    g_sorted = gid[order]
    first_of = np.concatenate([[True], g_sorted[1:] != g_sorted[:-1]])
    rank = np.arange(order.size) - np.maximum.accumulate(np.where(first_of, np.arange(order.size), 0))
    top = rank < k
    row_of_group = np.full(gstart.size, -1, dtype=np.int64)
    row_of_group[keep] = np.arange(keep.size)
    r = row_of_group[g_sorted[top]]
    nexts = np.full((keep.size, k), SEP, dtype=np.uint32)
    counts = np.zeros((keep.size, k), dtype=np.uint32)
    nexts[r, rank[top]] = nxt_u[order[top]]
    counts[r, rank[top]] = np.minimum(cnt_u[order[top]], 2**32 - 1)
    ctx = ctx_u[gstart[keep]]
    total = np.minimum(totals[keep], 2**32 - 1).astype(np.uint32)
    del ctx_u, nxt_u, cnt_u, gid
    # order rows by context hash for exact lookups
    hashes = hash_rows(ctx)
    horder = np.argsort(hashes, kind="stable")
    ctx, nexts, counts, total, hashes = ctx[horder], nexts[horder], counts[horder], total[horder], hashes[horder]
    t_table = time.perf_counter()

    emb = load_embeddings(model_dir)
    if emb.shape[0] < vocab_size:
        pad = np.zeros((vocab_size - emb.shape[0], emb.shape[1]), dtype=np.float32)
        emb = np.concatenate([emb, pad])
    table = project_embeddings(emb[:vocab_size], p["dim"])
    del emb
    dim = table.shape[1]
    vectors = np.empty((ctx.shape[0], dim), dtype=np.float32)
    for lo in range(0, ctx.shape[0], 65536):
        vectors[lo : lo + 65536] = embed_contexts(ctx[lo : lo + 65536], table, p["decay"])
    t_embed = time.perf_counter()

    kind = p["index"]
    if kind == "auto":
        kind = "flat" if ctx.shape[0] <= p["flat_max"] else "ivf"
    nlist = 0
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 64
    else:
        nlist = int(min(65536, max(16, round(math.sqrt(ctx.shape[0])))))
        nlist = min(nlist, max(1, ctx.shape[0] // 39))
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(0)
        sample = vectors[rng.choice(ctx.shape[0], size=min(ctx.shape[0], 40 * nlist), replace=False)]
        index.cp.niter = 10  # coarse lists need no more: they only route the search
        index.train(sample)
        index.quantizer_trains_alone = 0
    for lo in range(0, vectors.shape[0], 262144):
        index.add(vectors[lo : lo + 262144])
        if progress is not None:
            progress.advance("index", min(262144, vectors.shape[0] - lo), total=vectors.shape[0])
    del vectors
    t_index = time.perf_counter()

    ctx.tofile(directory / "ctx.u32")
    nexts.tofile(directory / "next.u32")
    counts.tofile(directory / "count.u32")
    total.tofile(directory / "total.u32")
    hashes.tofile(directory / "hash.u64")
    table.astype(np.float32).tofile(directory / "embed.f32")
    faiss.write_index(index, str(directory / "index.faiss"))
    info = {
        "contexts": int(ctx.shape[0]),
        "vocab_size": int(vocab_size),
        "dim": int(dim),
        "faiss": kind,
        "nlist": nlist,
        "table_s": round(t_table - t0, 3),
        "embed_s": round(t_embed - t_table, 3),
        "faiss_s": round(t_index - t_embed, 3),
    }
    return info, ["ctx.u32", "next.u32", "count.u32", "total.u32", "hash.u64", "embed.f32", "index.faiss"]


def import_faiss():
    """FAISS from either wheel: faiss-cpu (``pip install 'graft-sd[cpu]'``) or faiss-gpu-cu12 (``[cuda]``), which
    both provide the module ``faiss`` and so must never be installed together."""
    try:
        import faiss
    except ImportError:
        raise DatastoreError("n-gram datastores need FAISS: pip install 'graft-sd[cpu]' (faiss-cpu), or "
                             "'graft-sd[cuda]' (faiss-gpu-cu12) on a CUDA machine") from None
    return faiss


def _gpu_of(device: str) -> int:
    """The GPU number of a torch device name (``cuda`` is GPU 0, ``cuda:1`` GPU 1)."""
    _, _, number = device.partition(":")
    return int(number) if number.isdigit() else 0


class _NgramShard:
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
        ctx = [int(t) for t in context[-n:]]
        # level 1: the exact context (similarity 1) and its nearest neighbours
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
        if not hits:
            return Lookup()
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
        # deeper levels continue from the best hit's context: the exact one, else the nearest neighbour's
        best_si, best_row = max(hits, key=lambda key: hits[key])
        base = [int(t) for t in self.shards[best_si].ctx[best_row]]
        nodes: list[Continuation] = []
        heap: list[tuple[float, int, int, int, int, tuple[int, ...]]] = []
        serial = 0
        for t, w in weighted.items():
            score = conf * w / denom if denom > 0 else 0.0
            heapq.heappush(heap, (-score, serial, t, -1, raw[t], ()))
            serial += 1
        # best-first: pop the best pending node, emit it, push its children (exact n-gram continuations)
        while heap and len(nodes) < budget:
            neg, _, tok, parent, count, path = heapq.heappop(heap)
            idx = len(nodes)
            path = path + (tok,)
            nodes.append(Continuation(tok, parent, len(path), int(count), -neg))
            if len(path) >= depth:
                continue
            nxt_ctx = (base + list(path))[-n:]
            dist = self._exact_distribution(nxt_ctx)
            for t, (c, tot) in dist.items():
                heapq.heappush(heap, (neg * c / tot, serial, t, idx, c, path))
                serial += 1
        total = int(sum(self.shards[si].total[row] for si, row in hits))
        return Lookup(match_len=n if exact else 0, occurrences=total, counted=total, nodes=nodes, neighbours=neigh)
