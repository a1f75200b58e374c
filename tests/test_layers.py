"""The import layers: every import points down (or within its own layer), no import cycle anywhere (imports inside
functions and type-only imports included), graft_cli never imports plugins, plugins import only graft_cli's plugin
surface, and importing graft_cli changes nothing in the process."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# lowest first; a module belongs to the layer of the longest prefix that names it
LAYERS = [
    ("core", ["graft_cli.core", "datastores"]),
    ("catalog", ["graft_cli.catalog"]),
    ("model", ["graft_cli.runtime", "graft_cli.heads"]),
    ("policy", ["graft_cli.drafting", "graft_cli.plugin", "plugins"]),
    ("method configuration", ["graft_cli.method"]),
    ("application", ["graft_cli.api", "graft_cli.server", "graft_cli.bench"]),
    ("cli", ["graft_cli.cli", "graft_cli.__main__", "graft_cli"]),
]
PUBLIC = {"graft_cli.plugin"}  # all a plugin may import of graft_cli (docs/plugins.md)
# the command line puts its imports off until a command runs (`graft --help` must not load torch); elsewhere an
# import inside a function says why on its line, after "# lazy:" (an optional dependency, say)
LAZY_ALLOWED = ("graft_cli.cli", "graft_cli.__main__")


def modules() -> dict[str, Path]:
    found = {}
    for package in ("graft_cli", "plugins", "datastores"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".") or
                    (prefix.endswith("_") and module.startswith(prefix))) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer"
    return rank


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function without a "# lazy:" reason) for every import of
    ``name``."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name:
                reason = "# lazy:" in lines[node.lineno - 1] or "# lazy:" in lines[node.end_lineno - 1]
                found.append((target, node.lineno, id(node) in nested and not reason))
    return found


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_imports_point_down_the_layers():
    upward = [f"{name}:{line} imports {target} ({LAYERS[layer(target)][0]} above {LAYERS[layer(name)][0]})"
              for name, edges in graph().items() for target, line, _ in edges if layer(target) > layer(name)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = {name: {target for target, _, _ in out} for name, out in graph().items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_graft_cli_never_imports_plugins_and_plugins_use_public_names():
    wrong = []
    for name, edges in graph().items():
        for target, line, _ in edges:
            if name.startswith("graft_cli") and target.startswith("plugins"):
                wrong.append(f"{name}:{line} imports {target}")
            if name.startswith("plugins") and target.startswith("graft_cli") and target not in PUBLIC:
                wrong.append(f"{name}:{line} imports {target}, not graft_cli's plugin surface")
    assert not wrong, "\n".join(wrong)


def test_the_plugin_surface_imports_its_lazy_names_from_below_it():
    """graft_cli.plugin imports a drafter's names by their module's name when first asked for (no torch for a
    retriever), which the import graph above cannot see: they must point down the layers all the same."""
    from graft_cli import plugin

    upward = sorted({module for module, _ in plugin._LAZY.values() if layer(module) > layer("graft_cli.plugin")})
    assert not upward, upward


def test_no_module_name_in_both_plugins_and_datastores():
    """A plugin module is named for what it is (``store_retriever``), never after the store module it reads, so that
    a traceback, a grep or an entry point names one file."""
    names = lambda package: {path.stem for path in (ROOT / package).glob("*.py")} - {"__init__"}
    assert not names("plugins") & names("datastores")


def test_project_imports_inside_functions_only_in_the_command_line():
    lazy = [f"{name}:{line} imports {target} inside a function, with no reason" for name, edges in graph().items()
            for target, line, inside in edges if inside and not name.startswith(LAZY_ALLOWED)]
    assert not lazy, "\n".join(lazy)


def test_importing_graft_changes_nothing_in_the_process():
    code = """
import json, os, sys
import torch, transformers  # what they set for themselves at import is theirs (modeling_utils sets an inductor dir)
from transformers import AutoModelForCausalLM, modeling_utils
before = dict(os.environ)
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
registries = (sorted(AttentionInterface._global_mapping), sorted(AttentionMaskInterface._global_mapping))
import graft_cli, graft_cli.core, graft_cli.runtime, graft_cli.drafting, graft_cli.method.builder, graft_cli.heads
import graft_cli.plugin, plugins.prompt_lookup, plugins.draft_model, plugins.eagle3
after = (sorted(AttentionInterface._global_mapping), sorted(AttentionMaskInterface._global_mapping))
print(json.dumps({"environ": dict(os.environ) == before, "registries": registries == after}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"environ": True, "registries": True}
