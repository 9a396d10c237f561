"""How the packages may import each other, checked: no import circle, data flowing one way, fast help.

``thinker`` (the model, also shipped as remote code) imports nothing outside itself; ``thinker_common`` (what every
command shares) nothing of the project; ``converter`` may import those two, ``export`` all three. The import graph is
read from the sources (every ``import``, at module level or inside a function, since a lazy import closes a circle just
as well), so a new circle fails here whichever module a user happens to import first.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("thinker", "thinker_common", "converter", "export")
# What each package may import from the project besides itself.
ALLOWED = {
    "thinker": set(),
    "thinker_common": set(),
    "converter": {"thinker_common", "thinker"},
    "export": {"thinker_common", "thinker", "converter"},
}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports (and, as Python does, their parent packages), its own ancestors aside."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] + [f"{target}.{alias.name}" for alias in node.names]  # `from pkg import submodule`
        else:
            continue
        for name in names:
            parts = name.split(".")
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(modules)
    ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    return found - ancestors - {module}


@pytest.fixture(scope="module")
def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {module: imported_modules(module, path, modules) for module, path in modules.items()}


def test_packages_import_only_downstream(import_graph):
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph.items()
        for target in targets
        if target.split(".")[0] != module.split(".")[0] and target.split(".")[0] not in ALLOWED[module.split(".")[0]]
    ]
    assert wrong == []


def test_no_import_circle(import_graph):
    """Depth-first search for a back edge; the circle is reported as the path that closes it."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(import_graph[module]):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (circle := visit(target)):
                return circle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(import_graph):
        if module not in state:
            circle = visit(module)
            assert circle is None, " -> ".join(circle)


def test_the_graph_sees_lazy_imports(import_graph):
    # Guard against the checks above passing vacuously: the exporter converts a SOURCE on the way, lazily.
    assert "converter.convert" in import_graph["export.exporter"]
    assert "thinker_common.errors" in import_graph["converter.convert"]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_import_thinker_imports_nothing_outside_itself():
    done = run_python(
        "import sys, thinker\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'thinker_common', 'converter', 'export'}))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_users_common_py_does_not_hide_the_shared_package(tmp_path):
    """A script beside its own ``common.py`` (a usual name for one's helpers) imports the converter and the runtime:
    the shared package is ``thinker_common``, which no such file shadows (it was ``common``, which one did)."""
    (tmp_path / "common.py").write_text("HELPER = 1\n")
    (tmp_path / "script.py").write_text("import common, converter.load, export.runtime\nprint(common.HELPER)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


HEAVY = ("torch", "transformers", "onnx", "onnxruntime")


@pytest.mark.parametrize(
    "command",
    [
        ("thinker_common.cli", "main", ["--help"]),
        ("thinker_common.cli", "main", ["export", "--help"]),
        ("thinker_common.cli", "main", ["convert", "--help"]),
        ("thinker_common.cli", "main", ["generate", "--help"]),
        ("thinker_common.cli", "main", ["export", "--dtype", "int8", "a", "b"]),  # a usage error: exit 2
        ("converter.cli", "convert_command", ["--help"]),
        ("converter.cli", "convert_command", ["only-one-argument"]),
    ],
    ids=lambda command: " ".join(["thinker" if command[0] == "thinker_common.cli" else "thinker-convert", *command[2]]),
)
def test_help_and_usage_errors_import_no_heavy_library(command):
    """`--help` and click's argument errors answer without importing torch, transformers or onnxruntime."""
    module, name, args = command
    done = run_python(
        f"import sys\nfrom {module} import {name}\n"
        f"try:\n    {name}({args!r})\nexcept SystemExit as stop:\n    code = stop.code\n"
        f"print(code, sorted(set({HEAVY!r}) & set(sys.modules)))"
    )
    assert done.returncode == 0, done.stderr
    code, heavy = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert heavy == "[]"
    assert int(code) == (0 if "--help" in args else 2)
