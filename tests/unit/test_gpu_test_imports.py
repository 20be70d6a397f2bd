"""The GPU tests and the benchmarks only run on the GPU machine, where an import error costs device
time (a renamed helper once broke a GPU test's fixture for two sessions). Here, on the CPU, every
``from X import name`` in tests/gpu/*.py and benchmarks/*.py (at any depth, function bodies
included) that names a benchmark script or one of the project's packages must resolve."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "megatron_rz", "vllm_bridge")
FILES = sorted((ROOT / "tests" / "gpu").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module, [a.name for a in node.names]


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_project_imports_resolve(path):
    bad = []
    for line, module, names in _imports(path):
        script = ROOT / "benchmarks" / f"{module}.py"
        gpu_helper = ROOT / "tests" / "gpu" / f"{module}.py"
        if "." not in module and (script.exists() or gpu_helper.exists()):
            have = _top_level_names(script if script.exists() else gpu_helper)
            bad += [f"{path.name}:{line} {module}.{n}" for n in names if n != "*" and n not in have]
        elif module.split(".")[0] in PACKAGES:
            mod = importlib.import_module(module)
            for n in names:
                if n == "*" or hasattr(mod, n):
                    continue
                try:  # a submodule not imported by its package's __init__
                    importlib.import_module(f"{module}.{n}")
                except ImportError:
                    bad.append(f"{path.name}:{line} {module}.{n}")
    assert not bad, "imports that do not resolve: " + ", ".join(bad)
