"""The import layers: every import points down (or within its own layer), no import cycle anywhere (imports inside
functions and type-only imports included), graft_cli never imports plugins, plugins import only graft_cli's plugin
surface, and importing graft_cli changes nothing in the process. The scripts under benchmarks/ (a package run
with ``python -m benchmarks.NAME``) import each other as ``benchmarks.NAME``, without a cycle, and never edit
``sys.path``."""

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
    ("model", ["graft_cli.runtime", "graft_cli.models", "graft_cli.heads", "graft_cli.grammar"]),
    ("policy", ["graft_cli.drafting", "graft_cli.plugin", "plugins"]),
    ("method configuration", ["graft_cli.method"]),
    ("application", ["graft_cli.api", "graft_cli.server", "graft_cli.bench"]),
    ("cli", ["graft_cli.cli", "graft_cli.__main__", "graft_cli"]),
]
PUBLIC = {"graft_cli.plugin"}  # all a plugin may import of graft_cli (docs/plugins.md)
# the command line puts its imports off until a command runs (`graft --help` must not load torch); elsewhere an
# import inside a function says why on its line, after "# lazy:" (an optional dependency, say)
LAZY_ALLOWED = ("graft_cli.cli", "graft_cli.__main__")


PRODUCT = ("graft_cli", "plugins", "datastores")
# sys.path's methods that change it: a script that calls one imports by where it lies, not by package
PATH_EDITS = {"append", "insert", "extend", "remove", "pop", "clear", "reverse", "sort", "__setitem__", "__iadd__"}


def modules(packages: tuple[str, ...] = PRODUCT) -> dict[str, Path]:
    found = {}
    for package in packages:
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


def graph(packages: tuple[str, ...] = PRODUCT) -> dict[str, list[tuple[str, int, bool]]]:
    known = modules(packages)
    return {name: imports(name, path, known) for name, path in known.items()}


def test_imports_point_down_the_layers():
    upward = [f"{name}:{line} imports {target} ({LAYERS[layer(target)][0]} above {LAYERS[layer(name)][0]})"
              for name, edges in graph().items() for target, line, _ in edges if layer(target) > layer(name)]
    assert not upward, "\n".join(upward)


def cycle(graph_: dict[str, list[tuple[str, int, bool]]]) -> list[str] | None:
    """One import cycle of ``graph_`` (its modules in order, the first again at the end), or None."""
    edges = {name: {target for target, _, _ in out} for name, out in graph_.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    return next((found for node in sorted(edges) if node not in state and (found := visit(node))), None)


def test_no_import_cycle():
    found = cycle(graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def test_benchmarks_have_no_import_cycle():
    found = cycle(graph(("benchmarks",)))
    assert found is None, "import cycle: " + " -> ".join(found)


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def path_edits(tree: ast.AST) -> list[int]:
    """Lines that change ``sys.path``: a changing method called on it, an assignment to it or to an item of it,
    its deletion, or ``from sys import path`` (which would let it change under another name)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            targets = []
        if any(_is_sys_path(t) or isinstance(t, ast.Subscript) and _is_sys_path(t.value) for t in targets):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PATH_EDITS
              and _is_sys_path(node.func.value)):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_benchmarks_import_by_package_and_leave_sys_path_alone():
    """Run as ``python -m benchmarks.NAME`` from the checkout's root, a script finds its neighbours as
    ``benchmarks.NAME``; a bare ``import NAME`` of one would work only when run by its file, with its folder on
    the path, and so would tempt a ``sys.path`` edit."""
    assert path_edits(ast.parse("import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']")) == [2, 3]
    known = modules(("benchmarks",))
    bare = {name.rpartition(".")[2] for name in known}
    wrong = []
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        wrong += [f"{name}:{line} edits sys.path" for line in path_edits(tree)]
        for node in ast.walk(tree):
            tops = ([a.name.partition(".")[0] for a in node.names] if isinstance(node, ast.Import) else
                    [node.module.partition(".")[0]] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            wrong += [f"{name}:{node.lineno} imports {top} by its bare name, not as benchmarks.{top}"
                      for top in tops if top in bare and top != "benchmarks"]
    assert not wrong, "\n".join(wrong)


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


def protocol_members() -> set[str]:
    """Every member the roles declare (graft_cli/core/protocols.py), and the names once probed before they were."""
    from graft_cli.core import protocols

    members = {name for role in (protocols.Proposer, protocols.Drafter, protocols.Retriever)
               for name in (*vars(role), *role.__annotations__) if not name.startswith("_")}
    return members | set(protocols.Needs.__dataclass_fields__) | {"drafter", "inner", "feature_layers", "ahead"}


def test_no_getattr_probes_a_role():
    """What a proposer, drafter or retriever offers is declared (``Needs``, the protocols), never asked with
    ``getattr``/``hasattr``: a wrapper then forwards by construction, and a new member cannot be missed."""
    members, probes = protocol_members(), []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in members):
                probes.append(f"{name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert not probes, "\n".join(probes)
