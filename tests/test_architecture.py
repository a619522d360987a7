"""The package's import structure: no import cycle, every module imports on its own, the layers import downwards
only (`engine` <- `sim`, `trainer`; the plug-in registry a leaf; the developer tools in `testing` imported by no
core module), the engine never imports `trl`.

The import graph is read from the source with `ast`: a module -> every `trl_infinite` module it names in an `import`
or `from ... import` statement, relative imports resolved, `from pkg import sub` counted as an import of `pkg.sub`.
Imports inside functions are included (a lazy import is still a dependency); only imports under
`if TYPE_CHECKING:` are left out (they never run). An import of `a.b.c` also runs `a/__init__` and `a/b/__init__`;
those implicit parent edges are not counted (as import-linter does), the explicit ones are.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import trl_infinite

ROOT = pathlib.Path(trl_infinite.__file__).parent
PACKAGE = "trl_infinite"


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (path, is a package)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(package modules imported by `module`, top-level names of all modules it imports)."""
    path, is_pkg = MODULES[module]
    inner, top = set(), set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    top.add(alias.name.split(".")[0])
                    if alias.name in MODULES:
                        inner.add(alias.name)
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(module, is_pkg, child)
                top.add(target.split(".")[0])
                if target in MODULES:
                    inner.add(target)
                inner.update(f"{target}.{a.name}" for a in child.names if f"{target}.{a.name}" in MODULES)
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    inner.discard(module)
    return inner, top


GRAPH = {m: _imports(m)[0] for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_graph_walk_sees_the_package():
    assert len(MODULES) > 50
    assert "trl_infinite.engine.config.engine_config" in GRAPH["trl_infinite.engine.engine"]
    assert "trl_infinite.engine.sched.policies.base" in GRAPH["trl_infinite.engine.sched.policies.admission"]
    # the cycle finder finds a cycle when there is one
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_engine_never_imports_trl():
    offenders = [m for m in MODULES if not m.startswith(f"{PACKAGE}.trainer") and "trl" in _imports(m)[1]]
    assert offenders == []


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_layers_import_downwards_only():
    """engine <- sim, engine <- trainer; the engine imports neither, sim and trainer not each other; speculative
    decoding is part of the engine (`engine/spec_decode`)."""
    allowed = {"engine": {"engine"}, "sim": {"engine", "sim"}, "trainer": {"engine", "trainer"},
               "": {"engine", "trainer"}}  # the package's `__init__` re-exports (the trainer lazily)
    offenders = [(m, t) for m, targets in GRAPH.items() for t in targets if _layer(m) in allowed
                 and _layer(t) not in allowed[_layer(m)] | {"testing"} and t != PACKAGE]
    assert offenders == []
    assert "trl_infinite.engine.spec_decode" in MODULES and not any(m.startswith("trl_infinite.spec_decode")
                                                                     for m in MODULES)


def test_developer_tools_are_not_imported_by_the_core():
    """`trl_infinite.testing` (tiny configs, random models, offline weights, the model matrix) is for tests and
    benchmarks: only itself and command-line entry points (`__main__`, developer options only) import it."""
    offenders = [m for m, targets in GRAPH.items() for t in targets
                 if t.startswith(f"{PACKAGE}.testing") and _layer(m) != "testing" and not m.endswith("__main__")]
    assert offenders == []
    assert not (ROOT / "utils").exists()  # the old mixed `utils/` (core registry + dev tools) is gone
    pyproject = (ROOT.parent / "pyproject.toml").read_text()
    assert f'exclude = ["{PACKAGE}.testing*"]' in pyproject  # and the wheel does not ship them


# The engine's rooms, lowest first: a room imports only rooms of its own rank or lower (lazy imports included). The
# drive at the top of `engine/` (the `RolloutEngine`, one call, its loop and the model-backed executor) uses them all;
# `outputs` (what `generate` returns) sits with the configuration at the bottom.
ROOMS = {"config": 0, "outputs": 0, "sched": 1, "attention": 2, "runner": 3, "decode": 4, "model": 5,
         "spec_decode": 6, "engine": 7, "call": 7, "executor": 7, "": 7}
ENGINE = f"{PACKAGE}.engine"
MAX_LINES = 300


def _room(module: str) -> str | None:
    if module != ENGINE and not module.startswith(f"{ENGINE}."):
        return None
    return module.split(".")[2] if module != ENGINE else ""


def test_every_engine_module_is_in_a_room():
    assert sorted({_room(m) for m in MODULES} - {None} - set(ROOMS)) == []
    assert len([p for p in (ROOT / "engine").glob("*.py")]) <= 5  # the drive (engine, call, executor), `outputs` and `__init__`


def test_rooms_import_downwards_only():
    """No import from a lower room into a higher one: configuration <- scheduling <- attention <- runner <- decode
    step <- model adaptation <- speculative decoding <- the drive."""
    offenders = [(m, t) for m, targets in GRAPH.items() if _room(m) is not None for t in sorted(targets)
                 if _room(t) is not None and ROOMS[_room(t)] > ROOMS[_room(m)]]
    assert offenders == []


def test_scheduling_imports_no_torch():
    """Nothing under `engine/sched/` names torch (or transformers) in any import statement, lazy ones included; and
    importing the whole room in an interpreter where torch cannot be imported works (the package `__init__`s above
    it import lazily)."""
    sched = [m for m in MODULES if m.startswith(f"{ENGINE}.sched")]
    assert len(sched) >= 10
    offenders = sorted((m, name) for m in sched for name in _imports(m)[1] & {"torch", "transformers", "triton"})
    assert offenders == []
    script = ("import importlib, sys\n"
              "sys.modules['torch'] = sys.modules['transformers'] = None  # any import of them raises\n"
              f"for name in {sorted(sched)!r}:\n"
              "    importlib.import_module(name)\n")
    checkout = str(ROOT.parent)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=checkout,
                          env={**os.environ, "PYTHONPATH": checkout})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_no_module_over_300_lines():
    lines = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path, _ in MODULES.values()}
    assert {name: n for name, n in lines.items() if n > MAX_LINES} == {}


def test_plugin_registry_is_a_leaf():
    """The registries name the plug-ins' modules as strings: importing them imports no plug-in (nor anything else of
    the package), so `EngineConfig` validates names without loading schedulers, drafters or kernels."""
    assert GRAPH["trl_infinite.engine.config.registry"] == set()


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """One fresh interpreter; before each module, every `trl_infinite` module is dropped from `sys.modules`, so each
    is imported first, alone, the way a user's `import` would (heavy dependencies such as torch stay loaded)."""
    script = (
        "import importlib, sys\n"
        f"names = {sorted(MODULES)!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for m in [m for m in sys.modules if m == 'trl_infinite' or m.startswith('trl_infinite.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as err:\n"
        "        failed.append(f'{name}: {type(err).__name__}: {err}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    checkout = str(ROOT.parent)
    env = {**os.environ, "PYTHONPATH": checkout, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=checkout,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
