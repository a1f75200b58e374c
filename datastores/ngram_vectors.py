"""How the n-gram store turns a context into a vector, so that a context never seen verbatim still finds near ones.

Every context is embedded from the model's input-embedding rows of its ``n`` tokens, projected to ``dim``
whitened dimensions by PCA over the embedding table, weighted by position (the last token counts most, each
earlier one ``decay`` times less) and L2-normalised. A shard stores the projected table (``embed.f32``
``[V, dim]``) so that queries embed their context exactly as the build did.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from datastores.embeddings import load_embeddings

EMBED_CHUNK = 65536  # contexts embedded at a time: bounds the temporary arrays


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


def embedding_table(model_dir: Path, vocab_size: int, dim: int) -> np.ndarray:
    """The model's embedding rows projected (:func:`project_embeddings`), one row per token id of the tokenizer:
    a checkpoint with fewer rows than the vocabulary gets zero rows for the rest."""
    emb = load_embeddings(model_dir)
    if emb.shape[0] < vocab_size:
        pad = np.zeros((vocab_size - emb.shape[0], emb.shape[1]), dtype=np.float32)
        emb = np.concatenate([emb, pad])
    return project_embeddings(emb[:vocab_size], dim)


def embed_contexts(ctx: np.ndarray, table: np.ndarray, decay: float) -> np.ndarray:
    """The unit vectors of contexts ``ctx`` ``[N, n]``: their tokens' rows of ``table``, weighted by position."""
    n = ctx.shape[1]
    w = _position_weights(n, decay)
    out = np.zeros((ctx.shape[0], table.shape[1]), dtype=np.float32)
    for j in range(n):
        out += w[j] * table[ctx[:, j]]
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    np.divide(out, norms, out=out, where=norms > 0)
    return out


def context_vectors(ctx: np.ndarray, table: np.ndarray, decay: float) -> np.ndarray:
    """:func:`embed_contexts` of every stored context, a chunk at a time."""
    vectors = np.empty((ctx.shape[0], table.shape[1]), dtype=np.float32)
    for lo in range(0, ctx.shape[0], EMBED_CHUNK):
        vectors[lo : lo + EMBED_CHUNK] = embed_contexts(ctx[lo : lo + EMBED_CHUNK], table, decay)
    return vectors
