"""The benchmark's columns: which methods run, at which budgets, with which settings (``--variant``,
``--method-opt``)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from graft_cli.core import DraftSettings, GraftError
from graft_cli.method.config import TAKES_DRAFT, MethodConfig, configure

PEERS = ("hf", "hf-pld", "hf-assisted")


@dataclass
class MethodSpec:
    """One column of the benchmark: an engine method at a budget, or a transformers peer."""

    name: str  # what tables and files call it, e.g. pld or pld@8
    method: str  # ar, pld, ... or hf, hf-pld, hf-assisted
    kind: str  # "engine" or "peer"
    budget: Any = None  # int, "auto" or None (the device default)
    opts: dict[str, str] = field(default_factory=dict)  # a variant's own MethodConfig settings (--variant)

    def as_dict(self) -> dict:
        spec = {"name": self.name, "method": self.method, "kind": self.kind, "budget": self.budget}
        return spec | ({"opts": self.opts} if self.opts else {})


@dataclass(frozen=True)
class Variant:
    """A named engine method with settings of its own (``--variant deep=graft depth=14``), so that one run
    compares, say, dense at its best depth with graft at its own."""

    method: str
    opts: dict[str, str]


def plan_methods(names: Sequence[str], engine_methods: Sequence[str], budgets: Sequence[Any],
                 variants: dict[str, Variant] | None = None) -> list[MethodSpec]:
    """The benchmark's columns: ``ar`` first (always: it is the baseline), then the asked methods, engine
    methods and variants once per budget when several budgets are given (named ``method@budget``)."""
    variants = variants or {}
    for name, variant in variants.items():
        if name in engine_methods or name in PEERS:
            raise GraftError(f"--variant {name}: the name of a method; call the variant something else")
        if variant.method not in engine_methods or variant.method == "ar":
            raise GraftError(f"--variant {name}: '{variant.method}' is not an engine method other than ar")
    unknown = [n for n in names if n not in engine_methods and n not in PEERS and n not in variants]
    if unknown:
        choices = ", ".join([*engine_methods, *PEERS, *variants])
        raise GraftError(f"unknown method {', '.join(unknown)} (choose from {choices}, or all)")
    names = ["ar", *[n for n in dict.fromkeys(names) if n != "ar"]]
    budgets = list(budgets) or [None]
    specs = []
    for n in names:
        if n in PEERS:
            specs.append(MethodSpec(n, n, "peer"))
        elif n == "ar":
            specs.append(MethodSpec("ar", "ar", "engine"))
        else:
            variant = variants.get(n, Variant(n, {}))
            for b in budgets:
                specs.append(MethodSpec(n if len(budgets) == 1 else f"{n}@{b}", variant.method, "engine", b,
                                        dict(variant.opts)))
    return specs


class AskedMethods(NamedTuple):
    """``--methods`` read: the names, and whether the user named them (a method that cannot be built here then
    fails the run) or asked for ``all`` (it is left out with a warning)."""

    names: list[str]
    explicit: bool


def expand_methods(names: Sequence[str], engine_methods: Sequence[str], draft: str | None) -> AskedMethods:
    """``all`` means every engine method and every peer that can run."""
    if list(names) == ["all"]:
        peers = [p for p in PEERS if p != "hf-assisted" or draft]
        return AskedMethods([*engine_methods, *peers], explicit=False)
    return AskedMethods(list(names), explicit=True)


def method_config(spec: MethodSpec, options: dict, draft: str | None, method_opts: dict | None = None) -> MethodConfig:
    """The MethodConfig of an engine method: its budget, the retriever options, ``--draft`` where the method takes
    one (a variant's own ``draft=`` instead, so graft runs with a head and without in one run), and any other
    MethodConfig field given as text (``--method-opt depth=4``, then the variant's own), converted to the field's
    type; a dotted key (``responses.factor=1``) is a retriever option of its own."""
    own = dict(spec.opts)
    own_draft = own.pop("draft", None)  # a variant's own drafter: 'head=graft draft=eagle3:NAME' beside graft
    config = configure(spec.method, budget=spec.budget, retriever_options=options,
                       draft=own_draft or (draft if uses_draft(spec) else None))
    if spec.method == "ar":
        return config
    fields = {f.name for f in dataclasses.fields(MethodConfig)} - {"method", "budget", "options", "draft", "drafting"}
    drafting = {f.name for f in dataclasses.fields(DraftSettings)}
    hints = typing.get_type_hints(MethodConfig) | typing.get_type_hints(DraftSettings)
    settings = {}
    for key, text in ((method_opts or {}) | own).items():
        if "." in key:
            config.options[key] = text
            continue
        if key not in fields | drafting:
            raise GraftError(f"--method-opt {key}: not a method setting (choose from {', '.join(sorted(fields | drafting))})")
        value = _convert(text, hints.get(key), key)
        if key in fields:
            setattr(config, key, value)
        else:
            settings[key] = value
    config.drafting = dataclasses.replace(config.drafting, **settings)
    return config


def _convert(text: str, hint: Any, key: str) -> Any:
    """``--method-opt`` text as the field's type: the first of the hint's types that reads it."""
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if text.lower() in ("none", "") and type(None) in typing.get_args(hint):
        return None
    for kind in kinds:
        if typing.get_origin(kind) is list:
            return [part.strip() for part in text.split(",") if part.strip()]
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            continue
        if kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                continue
        if kind is str:
            return text
    raise GraftError(f"--method-opt {key}: cannot read '{text}' as {hint}")


def uses_draft(spec: MethodSpec) -> bool:
    """Whether a method takes ``--draft``: hf-assisted, and the engine methods ``methods.TAKES_DRAFT`` names."""
    if spec.kind == "peer":
        return spec.method == "hf-assisted"
    return spec.method in TAKES_DRAFT

