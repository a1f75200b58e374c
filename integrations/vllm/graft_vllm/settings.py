"""What the proposer drafts from, read from graft's own options: environment variables, or a TOML file that
``GRAFT_VLLM_CONFIG`` names (the environment wins key by key). vLLM never sees these keys, so none of them can be
refused by vLLM's configuration checks, and every engine process (each tensor-parallel worker) reads the same.

==============================  ======================================================================
``GRAFT_VLLM_RETRIEVERS``       comma-separated retriever plugins (default: ``prompt,responses``, and
                                ``suffix-array`` too when a datastore is named)
``GRAFT_VLLM_DATASTORE``        a graft datastore: a name under graft's home, or a path
``GRAFT_VLLM_OPTIONS``          retriever options as graft's ``--retriever-opt``: ``KEY=VALUE,KEY=VALUE``
                                (over :data:`MATCH_DEFAULTS`)
``GRAFT_VLLM_MIN_SCORE``        the lowest acceptance estimate a chain token may have (default 0.1)
``GRAFT_VLLM_MIN_EXPECTED``     the fewest tokens a chain must be expected to add to be sent (default 1.0)
``GRAFT_VLLM_LOOKUP``           nodes each retriever may return per lookup (default 32)
==============================  ======================================================================

In the TOML file the same keys are lowercase without the prefix: ``retrievers = ["prompt", "suffix-array"]``,
``datastore``, ``min_score``, ``min_expected``, ``min_expected_batched``, ``lookup`` and an ``[options]`` table.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from graft_cli.plugin import GraftError

PREFIX = "GRAFT_VLLM_"
STORE_RETRIEVER = "suffix-array"  # the retriever a named datastore brings when no list is given
DEFAULT_RETRIEVERS = ("prompt", "responses")
KEYS = ("retrievers", "datastore", "options", "min_score", "min_expected", "min_expected_batched", "lookup")
# Shortest matches a lookup drafts from, for the retrievers named: vLLM verifies one chain, counts a draft every
# time one is sent, and on a CPU pays for every drafted token, so a chain is worth sending only after a match that
# usually goes on as the model writes. Measured with SmolLM2-135M on quoted code and chat: the next token after a
# one-token match in the context, or a match of under six tokens in a code corpus (short n-grams recur in
# unrelated code: with four, the corpus added chains but hardly any accepted tokens), was rarely the model's.
# graft's own loop verifies trees, where such guesses cost little.
# The prompt lookup also continues a match that runs into the context's end as the text it repeats (``periodic``):
# a chain is then as long as the engine takes, where it would stop at the context's end, and a greedy small model
# that loops is drafted whole loops ahead.
MATCH_DEFAULTS = {"prompt": {"prompt.min_match": "2", "prompt.periodic": "1"},
                  STORE_RETRIEVER: {f"{STORE_RETRIEVER}.min_match": "6"}}


@dataclass(frozen=True)
class Settings:
    retrievers: tuple[str, ...] = DEFAULT_RETRIEVERS
    options: dict[str, str] = field(default_factory=dict)  # retriever options, graft's --retriever-opt
    # A chain ends at its first token estimated below ``min_score``, and is not sent when expected to add fewer
    # than ``min_expected`` tokens. Low, because what decides tokens per second is tokens accepted per step: one
    # request at a time a CPU verifies a few more tokens in about the time of one, so a token accepted one time in
    # ten still pays, while a withheld chain costs a whole step whenever it would have been accepted. Replayed on
    # the greedy outputs of SmolLM2-135M (12 quoted stdlib files and 12 chat prompts, 160 tokens each), 0.1 and 1
    # took 9-10% fewer steps than 0.3 and 2 on the code and 9% fewer on the chat, still well ahead of ``ngram`` in
    # accepted tokens per chain.
    # With several requests in a step the CPU's verification is bound by arithmetic, not by reading the weights:
    # every drafted token costs its share, and a chain must be surer to pay (``min_expected_batched``). At 8 at once
    # on the quoted corpus a bar of 1 gave 85.1 tok/s against ngram's 86.4, and 2 gave 90.0 against 84.4 (docs/vllm.md).
    min_score: float = 0.1
    min_expected: float = 1.0
    min_expected_batched: float = 2.0
    lookup: int = 32  # nodes a retriever may return per lookup: the tree the best chain is chosen from

    def __post_init__(self) -> None:
        if not self.retrievers:
            raise GraftError("graft-vllm: no retrievers named (GRAFT_VLLM_RETRIEVERS)")
        if not 0.0 <= self.min_score <= 1.0:
            raise GraftError(f"graft-vllm: min_score must be between 0 and 1, not {self.min_score}")
        for key, value in (("min_expected", self.min_expected), ("min_expected_batched", self.min_expected_batched)):
            if value < 0:
                raise GraftError(f"graft-vllm: {key} must be at least 0, not {value}")
        if self.lookup < 1:
            raise GraftError(f"graft-vllm: lookup must be at least 1, not {self.lookup}")


def read(environ: Mapping[str, str] | None = None, given: Mapping[str, Any] | None = None) -> Settings:
    """The settings of this process: ``given`` (a vLLM method's own options, where vLLM passes them) over the
    environment over the file ``GRAFT_VLLM_CONFIG``. A value that cannot be read is one GraftError line."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = environ.get(PREFIX + "CONFIG")
    if path:
        values.update(_file(Path(path).expanduser()))
    for key in KEYS:
        raw = environ.get(PREFIX + key.upper())
        if raw:
            values[key] = raw
    values.update(given or {})
    return _settings(values)


def _file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise GraftError(f"graft-vllm: cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise GraftError(f"graft-vllm: {path} is not TOML: {e}") from None


def _settings(values: dict[str, Any]) -> Settings:
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise GraftError(f"graft-vllm: unknown setting {unknown[0]!r} ({', '.join(KEYS)})")
    datastore = values.get("datastore")
    names = values.get("retrievers")
    if names is None:
        retrievers = DEFAULT_RETRIEVERS + ((STORE_RETRIEVER,) if datastore else ())
    else:
        retrievers = tuple(n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip())
    options = {key: value for name in retrievers for key, value in MATCH_DEFAULTS.get(name, {}).items()}
    options.update(_options(values.get("options", {})))
    if datastore:
        options["datastore"] = str(datastore)
    return Settings(retrievers, options, _number(values, "min_score", Settings.min_score, float),
                    _number(values, "min_expected", Settings.min_expected, float),
                    _number(values, "min_expected_batched", Settings.min_expected_batched, float),
                    _number(values, "lookup", Settings.lookup, int))


def _options(raw: str | Mapping[str, Any]) -> dict[str, str]:
    """``KEY=VALUE,KEY=VALUE`` (the environment) or a table (the file) as graft's string options."""
    if not isinstance(raw, str):
        return {str(k): str(v) for k, v in raw.items()}
    options = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise GraftError(f"graft-vllm: option {item!r} is not KEY=VALUE")
        options[key.strip()] = value.strip()
    return options


def _number(values: dict[str, Any], key: str, default: float, cast: type) -> Any:
    raw = values.get(key, default)
    try:
        return cast(raw)
    except (TypeError, ValueError):
        raise GraftError(f"graft-vllm: {key} must be a {cast.__name__}, not {raw!r}") from None
