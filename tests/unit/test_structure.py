"""Structure rules of the code base, read from the source with ``ast`` (nothing is imported).

Rules (docs: ../shared/ARCHITECTURE.md, docs/architecture.md): no import circles among the
project modules (function-level imports included); ``kernels`` imports neither vLLM nor Megatron;
``vllm_bridge`` imports nothing from ``megatron_rz``; ``megatron_rz`` imports nothing from
``vllm_bridge.aligned`` and ``megatron_rz.learner`` nothing from ``vllm_bridge`` or vLLM; no module reads another project module's private (``_x``) names;
``megatron_rz``'s role sub-packages import only downwards (``LAYERS``).

Run as a script (``python tests/unit/test_structure.py``) to print every cycle and violation.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron_rz", "vllm_bridge", "kernels", "benchmarks")

# Known exceptions, owned by the engineer merging the two training loops into one.
# These lists must only ever SHRINK: delete an entry as soon as its reason is gone.
ALLOWED_CYCLES: list[set[str]] = []
# Modules being rewritten around one rollout client / weight-transport seam; their
# private-name uses (engine `_rpc`, `_guard`, `_version`, ...) disappear with that rewrite.
ALLOWED_PRIVATE_USERS: set[str] = set()
# (user, owner) pairs allowed to share a private name: none left.
ALLOWED_PRIVATE_PAIRS: set[tuple[str, str]] = set()


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: set[str] = field(default_factory=set)  # project modules and external top-level names
    private_uses: list[tuple[str, str]] = field(default_factory=list)  # (owner module, "line: use")
    private_defs: set[str] = field(default_factory=set)  # private names this module defines
    tree: ast.AST | None = None


def _module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def collect() -> dict[str, Module]:
    """Every project module with its imports (all levels) and its uses of others' private names."""
    modules: dict[str, Module] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name, is_package = _module_name(path)
            modules[name] = Module(name, path, is_package)
    for mod in modules.values():
        _scan(mod, modules)
    object_private_uses(modules)
    return modules


def _resolve(mod: Module, level: int, target: str | None) -> str:
    base = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _project(name: str, modules: dict[str, Module]) -> str | None:
    """The longest prefix of a dotted name that is a project module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in modules:
            return cand
    return None


def _script_sibling(mod: Module, name: str, modules: dict[str, Module]) -> str:
    """Scripts in a folder without __init__.py (benchmarks/) put their folder on sys.path, so a
    bare ``import gpu_kernels`` there is the sibling ``benchmarks.gpu_kernels``."""
    folder = mod.path.parent
    if (folder / "__init__.py").exists() or folder == ROOT:
        return name
    sibling = ".".join(mod.name.split(".")[:-1] + [name])
    return sibling if _project(sibling, modules) and not _project(name, modules) else name


def _scan(mod: Module, modules: dict[str, Module]) -> None:
    tree = mod.tree = ast.parse(mod.path.read_text(), str(mod.path))
    aliases: dict[str, str] = {}  # local name -> project module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                name = _script_sibling(mod, a.name, modules)
                mod.imports.add(name)
                target = _project(name, modules)
                if target:
                    aliases[a.asname or a.name.split(".")[0]] = target if a.asname or name != a.name \
                        else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(mod, node.level, node.module) if node.level else (node.module or "")
            src = _script_sibling(mod, src, modules) if not node.level else src
            for a in node.names:
                sub = f"{src}.{a.name}"
                if sub in modules:  # `from pkg import submodule`
                    mod.imports.add(sub)
                    aliases[a.asname or a.name] = sub
                else:
                    mod.imports.add(src)
                    owner = _project(src, modules)
                    if _is_private(a.name) and owner and owner != mod.name:
                        mod.private_uses.append((owner, f"{node.lineno}: from {src} import {a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain = _dotted(node.value)
            if chain is None:
                continue
            head, *rest = chain.split(".")
            if head not in aliases:
                continue
            target = ".".join([aliases[head], *rest])
            if target in modules and target != mod.name:
                mod.private_uses.append((target, f"{node.lineno}: {chain}.{node.attr}"))
    mod.private_defs = _private_defs(tree)


def _private_defs(tree: ast.AST) -> set[str]:
    """Private functions, classes, module globals and ``self._x`` attributes a module defines."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            name = node.attr
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            name = node.id
        else:
            continue
        if _is_private(name):
            out.add(name)
    return out


def object_private_uses(modules: dict[str, Module]) -> None:
    """Add ``obj._x`` uses (obj not self / cls) of a private ``_x`` that a project module this one
    imports defines and this one does not: reading another module's objects' privates (e.g. an
    engine's ``_rpc``)."""
    edges = graph(modules)
    for mod in modules.values():
        for node in ast.walk(mod.tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in mod.private_defs:
                continue
            owners = sorted(o for o in edges[mod.name] if node.attr in modules[o].private_defs)
            use = f"{node.lineno}: {ast.unparse(node)}"
            if owners and not any(use == u for _, u in mod.private_uses):
                mod.private_uses.append((owners[0], use))


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module -> project modules it imports (a package import counts as importing its __init__)."""
    edges: dict[str, set[str]] = {}
    for mod in modules.values():
        out = set()
        for imp in mod.imports:
            target = _project(imp, modules)
            if target and target != mod.name:
                out.add(target)
        edges[mod.name] = out
    return edges


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _imports_from(modules: dict[str, Module], user: str, banned: tuple[str, ...]) -> list[str]:
    bad = []
    for mod in modules.values():
        if mod.name == user or mod.name.startswith(user + "."):
            for imp in sorted(mod.imports):
                if any(imp == b or imp.startswith(b + ".") for b in banned):
                    bad.append(f"{mod.name} imports {imp}")
    return bad


# ----------------------------------------------------------------------------------------- tests
_MODULES = None


def _modules() -> dict[str, Module]:
    global _MODULES
    if _MODULES is None:
        _MODULES = collect()
    return _MODULES


def test_no_import_cycles():
    found = cycles(graph(_modules()))
    unexpected = [sorted(c) for c in found if c not in ALLOWED_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"


def test_allowed_cycles_still_exist():
    """An allow-listed cycle that is gone must leave the list (the list only shrinks)."""
    found = cycles(graph(_modules()))
    stale = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert not stale, f"remove from ALLOWED_CYCLES (no longer a cycle): {stale}"


def test_kernels_framework_free():
    assert not _imports_from(_modules(), "kernels", ("vllm", "megatron", "megatron_rz", "vllm_bridge"))


def test_vllm_bridge_never_imports_megatron():
    assert not _imports_from(_modules(), "vllm_bridge", ("megatron_rz", "megatron"))


def test_learner_never_imports_aligned_vllm_classes():
    assert not _imports_from(_modules(), "megatron_rz", ("vllm_bridge.aligned",))


def test_learner_package_never_imports_the_bridge():
    """The learner yields HF-named tensors and pieces; bucketing, transports and resharding plans are
    the loop's (megatron_rz.loop.weights) and the bridge's business."""
    bad = _imports_from(_modules(), "megatron_rz.learner", ("vllm_bridge", "vllm"))
    assert not bad, bad


# megatron_rz's sub-packages by role, lowest first: a module may import megatron_rz modules of its
# own layer or below, never above (the shared leaves recipe / cluster / fingerprint / manifest are layer 0,
# the CLI the top).
LAYERS = (("megatron_rz.recipe", "megatron_rz.cluster", "megatron_rz.fingerprint", "megatron_rz.manifest"),
          ("megatron_rz.rl",),
          ("megatron_rz.learner",), ("megatron_rz.launch",), ("megatron_rz.loop",), ("megatron_rz.tools",),
          ("megatron_rz.cli",))


def _layer(name: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


def test_megatron_rz_layers_import_only_downwards():
    mods = _modules()
    unplaced = sorted(n for n in mods if n.startswith("megatron_rz.") and _layer(n) is None)
    assert not unplaced, f"megatron_rz modules outside the role layers (add them to LAYERS): {unplaced}"
    bad = []
    for m in mods.values():
        lu = _layer(m.name)
        if lu is None:
            continue
        for imp in sorted(m.imports):
            li = _layer(imp)
            if li is not None and li > lu:
                bad.append(f"{m.name} (layer {lu}) imports {imp} (layer {li})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_megatron_rz_subpackages_say_their_job():
    for pkg in sorted(p for p in (ROOT / "megatron_rz").iterdir() if (p / "__init__.py").is_file()):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) == 1, f"megatron_rz/{pkg.name}/__init__.py needs a one-line docstring of its job"


def _private_allowed(user: str, owner: str) -> bool:
    return user in ALLOWED_PRIVATE_USERS or (user, owner) in ALLOWED_PRIVATE_PAIRS


def test_no_private_names_across_modules():
    bad = [f"{m.name}:{u}" for m in _modules().values() for owner, u in m.private_uses
           if not _private_allowed(m.name, owner)]
    assert not bad, "private names of other modules used:\n" + "\n".join(bad)


def test_allowed_private_exceptions_still_exist():
    """Allow-list entries whose module is gone, or pairs no longer used, must leave the lists.
    (A rewritten module with no private uses left should leave ALLOWED_PRIVATE_USERS too.)"""
    mods = _modules()
    gone = sorted(n for n in ALLOWED_PRIVATE_USERS if n not in mods)
    unused = sorted(p for p in ALLOWED_PRIVATE_PAIRS
                    if p[0] not in mods or not any(o == p[1] for o, _ in mods[p[0]].private_uses))
    assert not gone and not unused, f"remove from the allow-lists: {gone + unused}"


def main() -> int:
    modules = _modules()
    for c in cycles(graph(modules)):
        print("cycle:", " <-> ".join(sorted(c)), "(allowed)" if c in ALLOWED_CYCLES else "")
    for user, banned in (("kernels", ("vllm", "megatron", "megatron_rz", "vllm_bridge")),
                         ("vllm_bridge", ("megatron_rz", "megatron")),
                         ("megatron_rz", ("vllm_bridge.aligned",))):
        for line in _imports_from(modules, user, banned):
            print("layering:", line)
    for m in modules.values():
        for owner, u in m.private_uses:
            print("private:", f"{m.name}:{u}", "(allowed)" if _private_allowed(m.name, owner) else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
