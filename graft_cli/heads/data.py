"""Training data for a head: corpus records to token documents (chat-templated where a record is an
instruction and its response), a held-out split, the draft vocabulary, and packed batches.

A corpus can also be tokenised once into a packed token file (``.npz``: the token ids as uint16 where the
vocabulary fits, the document offsets, and the tokenizer's fingerprint), which training reads without the text or
the tokenizer's time: how a corpus travels to a machine that has no copy of it (benchmarks/transport/gpu_pack.py).

Every batch is a pure function of (seed, step), so a resumed run sees exactly the batches it would have seen:
epoch ``e`` packs the training documents in the order of a permutation seeded with ``seed + e``, cut into
sequences of ``seq_len`` tokens; a document keeps its own positions and never attends across its boundary.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from datastores.atomic import atomic_file
from datastores.corpus import Corpus, extract_text
from datastores.errors import DatastoreError
from graft_cli.core import GraftError
from graft_cli.runtime.token_ranking import Ranking

PROMPT_KEYS = ("instruction", "question", "prompt")
ANSWER_KEYS = ("response", "output", "answer", "completion")
TOKENIZE_BATCH = 256
PACKED_FORMAT = "graft-tokens-1"
PACKED_SUFFIX = ".npz"


def chat_messages(record: Any) -> list[dict] | None:
    """An instruction/response record (``instruction`` [+ ``input``] / ``response``, ``question`` / ``answer``,
    ...) or a ``messages`` list as chat messages; ``None`` for anything else."""
    if not isinstance(record, dict):
        return None
    messages = record.get("messages")
    if isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    prompt = next((record[k] for k in PROMPT_KEYS if isinstance(record.get(k), str) and record[k].strip()), None)
    answer = next((record[k] for k in ANSWER_KEYS if isinstance(record.get(k), str) and record[k].strip()), None)
    if prompt is None or answer is None:
        return None
    extra = record.get("input")
    if isinstance(extra, str) and extra.strip():
        prompt = f"{prompt}\n\n{extra}"
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def record_text(tokenizer: Any, fields: Sequence[str] | None,
                regenerate: Callable[[list[dict]], str] | None = None) -> Callable[[Any], str | None]:
    """A record's training text: chat-templated when it is a conversation and the tokenizer has a template;
    ``regenerate`` (heads/regenerate.py) replaces a final assistant reply by the target's own."""
    templated = bool(getattr(tokenizer, "chat_template", None)) and not fields

    def text(record: Any) -> str | None:
        messages = chat_messages(record) if templated else None
        if messages is None:
            return extract_text(record, fields)
        if regenerate is not None and messages[-1]["role"] == "assistant":
            messages = [*messages[:-1], {"role": "assistant", "content": regenerate(messages[:-1])}]
        return tokenizer.apply_chat_template(messages, tokenize=False)

    return text


@dataclass
class Documents:
    """Token documents back to back: document i is ``tokens[starts[i]:starts[i + 1]]``."""

    tokens: np.ndarray  # int64
    starts: np.ndarray  # int64, len = documents + 1

    def __len__(self) -> int:
        return len(self.starts) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def subset(self, index: np.ndarray) -> "Documents":
        pieces = [self.tokens[self.starts[i]:self.starts[i + 1]] for i in index]
        starts = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        return Documents(tokens.astype(np.int64), starts)


def read_documents(sources: Sequence[str], tokenizer: Any, fields: Sequence[str] | None = None,
                   max_documents: int | None = None,
                   regenerate: Callable[[list[dict]], str] | None = None) -> tuple[Documents, str]:
    """Tokenise a corpus (datastores' readers: JSONL, Parquet/Arrow, folders), or read a packed token file;
    returns the documents and the corpus summary line. Documents of fewer than 2 tokens are dropped (nothing to
    predict)."""
    if any(is_packed(source) for source in sources):
        if len(sources) > 1:
            raise GraftError("a packed token file (.npz) is a whole corpus: give it as the only --data")
        if fields or regenerate is not None:
            raise GraftError("--field and --regenerate read text, and a packed token file (.npz) holds token ids")
        docs, summary = read_packed(Path(sources[0]), tokenizer)
        return (docs.subset(np.arange(min(max_documents, len(docs)))) if max_documents else docs), summary
    try:
        corpus = Corpus(sources, fields=fields, record_text=record_text(tokenizer, fields, regenerate))
        pieces: list[np.ndarray] = []
        batch: list[str] = []

        def flush() -> None:
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                if len(ids) >= 2:
                    pieces.append(np.asarray(ids, dtype=np.int64))
            batch.clear()

        for text in corpus:
            batch.append(text)
            if len(batch) == TOKENIZE_BATCH:
                flush()
            if max_documents is not None and len(pieces) + len(batch) >= max_documents:
                break
        flush()
    except DatastoreError as e:
        raise GraftError(str(e)) from None
    if not pieces:
        raise GraftError(f"the corpus has no documents to train on ({corpus.stats.summary()})")
    pieces = pieces[:max_documents] if max_documents else pieces
    starts = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
    return Documents(np.concatenate(pieces), starts), corpus.stats.summary()


def is_packed(source: str | Path) -> bool:
    """A packed token file is named ``*.npz`` (no corpus reader takes that suffix)."""
    return str(source).endswith(PACKED_SUFFIX)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """The sha256 of the tokenizer's vocabulary (token to id, added tokens included): packed ids are the same text
    only under the same vocabulary, so a file packed with another tokenizer is refused rather than trained on."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def write_packed(path: Path, docs: Documents, summary: str, tokenizer: Any) -> dict:
    """Write ``docs`` as a packed token file (atomically; numpy's ``.npz``, no pickles); returns its metadata.
    Ids are uint16 where the vocabulary fits (SmolLM2's 49,152 tokens: 2 bytes a token), else uint32."""
    vocab = len(tokenizer)
    meta = {"format": PACKED_FORMAT, "vocab": vocab, "tokenizer": tokenizer_fingerprint(tokenizer),
            "corpus": summary, "documents": len(docs), "tokens": int(docs.starts[-1])}
    if len(docs.tokens) and (int(docs.tokens.min()) < 0 or int(docs.tokens.max()) >= vocab):
        raise GraftError(f"token ids outside the tokenizer's vocabulary of {vocab:,}")
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    with atomic_file(Path(path)) as tmp, open(tmp, "wb") as f:
        np.savez(f, tokens=docs.tokens.astype(dtype), starts=docs.starts.astype(np.int64),
                 meta=np.array(json.dumps(meta)))
    return meta


def read_packed(path: Path, tokenizer: Any) -> tuple[Documents, str]:
    """A packed token file's documents and summary line, after checking that its offsets are whole and that it was
    packed with this tokenizer (any fault is one GraftError naming the file)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            tokens, starts, meta = z["tokens"], z["starts"], json.loads(str(z["meta"]))
    except FileNotFoundError:
        raise GraftError(f"no such file: {path}") from None
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GraftError(f"{path} is not a packed token file ({detail})") from None
    if not isinstance(meta, dict) or meta.get("format") != PACKED_FORMAT:
        raise GraftError(f"{path} is not a packed token file of format {PACKED_FORMAT}")
    if meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):
        raise GraftError(f"{path} was packed with another tokenizer than the target's: pack it again for this model")
    whole = (tokens.ndim == starts.ndim == 1 and tokens.dtype.kind == "u" and starts.dtype.kind in "iu"
             and len(starts) >= 2 and starts[0] == 0 and starts[-1] == len(tokens)
             and bool((np.diff(starts) >= 0).all()))
    if not whole or (len(tokens) and int(tokens.max()) >= int(meta.get("vocab", 0))):
        raise GraftError(f"{path} is damaged: its token ids and document offsets do not agree")
    summary = f"{meta.get('corpus', '')}; packed in {path.name}"
    return Documents(tokens.astype(np.int64), starts.astype(np.int64)), summary


def split(docs: Documents, heldout_every: int) -> tuple[Documents, Documents]:
    """Every ``heldout_every``-th document is held out (a fixed, corpus-order split)."""
    index = np.arange(len(docs))
    held = index % heldout_every == heldout_every // 2
    if held.all() or not held.any():
        raise GraftError(f"the corpus has {len(docs)} documents: too few for a held-out split of 1 in {heldout_every}")
    return docs.subset(index[~held]), docs.subset(index[held])


def draft_vocabulary(docs: Documents, vocab: int, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent target tokens of the training data (ties to the lower id), ascending, and the
    share of training tokens they cover."""
    if not 0 < size <= vocab:
        raise GraftError(f"--draft-vocab must be in 1..{vocab}, got {size}")
    ranking = Ranking.count(docs.tokens, vocab, "")
    return torch.from_numpy(ranking.top(size)), ranking.coverage(size)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, L] position inside its document
    docs: torch.Tensor  # [B, L] a document id, unique inside the batch

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.tokens.to(device), self.positions.to(device), self.docs.to(device))


class Packer:
    """Packed sequences of one document set; batch ``b`` of epoch ``e`` is the same on every call."""

    def __init__(self, docs: Documents, seq_len: int, batch_size: int, seed: int) -> None:
        self.docs, self.seq_len, self.batch_size, self.seed = docs, seq_len, batch_size, seed
        self.sequences = int(docs.starts[-1]) // seq_len
        if self.sequences < batch_size:
            raise GraftError(f"{int(docs.starts[-1]):,} tokens make {self.sequences} sequences of {seq_len}: "
                             f"fewer than one batch of {batch_size}")
        self.batches_per_epoch = self.sequences // batch_size
        self._epoch: tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None

    def _pack(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        d = self.docs.subset(order)
        lengths = d.lengths()
        doc_of = np.repeat(np.arange(len(lengths)), lengths)
        positions = np.arange(len(d.tokens)) - np.repeat(d.starts[:-1], lengths)
        n = self.sequences * self.seq_len
        shape = (self.sequences, self.seq_len)
        return d.tokens[:n].reshape(shape), positions[:n].reshape(shape), doc_of[:n].reshape(shape)

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._epoch is None or self._epoch[0] != e:
            gen = torch.Generator().manual_seed(self.seed + e)
            order = torch.randperm(len(self.docs), generator=gen).numpy()
            self._epoch = (e, self._pack(order))
        return self._epoch[1]

    def batch(self, step: int) -> Batch:
        """The batch of training step ``step`` (0-based), epochs following each other."""
        e, b = divmod(step, self.batches_per_epoch)
        tokens, positions, docs = self.epoch(e)
        rows = slice(b * self.batch_size, (b + 1) * self.batch_size)
        return Batch(*(torch.from_numpy(np.ascontiguousarray(a[rows])) for a in (tokens, positions, docs)))

    def fixed(self, count: int) -> list[Batch]:
        """The first ``count`` sequences in corpus order, in batches (the held-out set)."""
        tokens, positions, docs = self._pack(np.arange(len(self.docs)))
        count = min(count, self.sequences)
        out = []
        for start in range(0, count, self.batch_size):
            rows = slice(start, min(start + self.batch_size, count))
            out.append(Batch(*(torch.from_numpy(np.ascontiguousarray(a[rows])) for a in (tokens, positions, docs))))
        return out
