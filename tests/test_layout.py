"""Package layout (issue 9 §5): the numerical core imports nothing from the runner, eval, bench, plan
or report; each outer part builds on the core only, and the runner is the one place that joins them;
kvtransfer's modules import one another without cycles.

What counts as an import here -- all of them, wherever they sit:
- `import kvtransfer.x` / `from kvtransfer.x import y` / relative `from .x import y`, at module level,
  inside functions and classes (a lazy import is still a dependency, and it closes a cycle the first
  time it runs), and under `if TYPE_CHECKING:`;
- `importlib.import_module("kvtransfer.x")` with a literal name, and "kvtransfer.x:attr" strings (the
  form of a lazy "module:attribute" table, which imports x when it is resolved);
- importing `kvtransfer.a.b` also runs the package `kvtransfer.a` (its __init__), so that is an edge
  too, unless the importer already lives inside `kvtransfer.a` (then the package is initialised).
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "kvtransfer"

# The numerical core: the paper's method in kvtransfer.core (what `import kvtransfer` offers), with what it stands on:
# kvtransfer.config (the resolved config, model and data identity, provenance, hub access) and the package's data
# tables (kvtransfer.resources).
CORE_PACKAGES = ("kvtransfer.core", "kvtransfer.config", "kvtransfer.resources")
# The parts built on the core, and what each may import besides the core and itself. Only the runner
# joins them (a run's stages call eval, bench, plan and report).
OUTER = {
    "kvtransfer.maps": set(),   # map kinds beyond the paper: built on the core alone
    "kvtransfer.eval": {"kvtransfer.maps"},
    "kvtransfer.bench": set(),
    "kvtransfer.plan": {"kvtransfer.maps"},   # the plan sizes every map kind's structures
    "kvtransfer.report": set(),
    "kvtransfer.runner": {"kvtransfer.maps", "kvtransfer.eval", "kvtransfer.bench", "kvtransfer.plan",
                          "kvtransfer.report"},
    # the dry run drives a whole run (the runner, with its preflight) on stand-ins, after the real run's plan
    "kvtransfer.dryrun": {"kvtransfer.runner", "kvtransfer.plan"},
    # the vLLM connector: loaded by vLLM's worker, so the core only (no runner, eval, report; see below)
    "kvtransfer.serve": set(),
    # the `kvtransfer-run` entry point (run.py): a run, or a dry run, and its closing table
    "kvtransfer.cli": {"kvtransfer.runner", "kvtransfer.dryrun", "kvtransfer.eval"},
}
_STRING_REF = re.compile(r"kvtransfer(?:\.\w+)+:\w+")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _targets(importer: str, tree: ast.AST) -> set[str]:
    """Every kvtransfer module `importer` imports (see the module docstring for what counts)."""
    own_package = importer if _is_package(importer) else importer.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own_package.split(".")
                base = ".".join(base[:len(base) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule, else pkg
                named.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            named.add(node.args[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named.update(ref.partition(":")[0] for ref in _STRING_REF.findall(node.value))
    out = set()
    for name in named:
        if name not in MODULES:
            continue
        out.add(name)
        parts = name.split(".")
        for i in range(1, len(parts)):  # the packages a fresh import of `name` initialises on the way
            parent = ".".join(parts[:i])
            if not (importer == parent or importer.startswith(parent + ".")):
                out.add(parent)
    out.discard(importer)
    return out


def import_graph() -> dict[str, set[str]]:
    return {name: _targets(name, ast.parse(path.read_text(), str(path))) for name, path in MODULES.items()}


def _part(name: str) -> str:
    if name == "kvtransfer" or any(name == p or name.startswith(p + ".") for p in CORE_PACKAGES):
        return "core"
    for part in OUTER:
        if name == part or name.startswith(part + "."):
            return part
    raise AssertionError(f"{name} belongs to no part of the layout: put it under CORE_PACKAGES or OUTER in {__file__}")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_and_relative_imports():
    """The parser itself: relative, function-level, import_module and "module:attr" imports all count,
    and a submodule of another package initialises that package too."""
    src = ("from . import tables\nfrom ..core.io import atomic_write_json\n\ndef f():\n"
           "    from ..eval import adapter\n    import importlib\n    importlib.import_module('kvtransfer.core.ridge')\n\n"
           "KINDS = {'mlp': 'kvtransfer.maps.mlp:MLPMapper'}\n")
    assert _targets("kvtransfer.report.sweep", ast.parse(src)) == {
        "kvtransfer.report.tables", "kvtransfer.core", "kvtransfer.core.io", "kvtransfer.eval",
        "kvtransfer.eval.adapter", "kvtransfer.core.ridge", "kvtransfer.maps", "kvtransfer.maps.mlp"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_has_a_place_in_the_layout():
    parts = {name: _part(name) for name in MODULES}
    assert {"core", *OUTER} == set(parts.values())
    for part in ("kvtransfer.core", "kvtransfer.maps", "kvtransfer.config", "kvtransfer.runner", "kvtransfer.bench"):
        assert _is_package(part), f"{part} is a subpackage"


def test_the_package_root_holds_subpackages_and_at_most_a_handful_of_modules():
    """Issue 33: the root shows the architecture; a module belongs to the subpackage of its part."""
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 4, root


def test_the_paper_method_reads_alone():
    """kvtransfer.core imports only itself, kvtransfer.config and the data tables: no map kind beyond the paper."""
    graph = import_graph()
    bad = {name: sorted(t for t in targets if not t.startswith(CORE_PACKAGES) and t != "kvtransfer")
           for name, targets in graph.items() if name.startswith("kvtransfer.core")}
    assert {k: v for k, v in bad.items() if v} == {}


# Length is not the rule: a module is cut where responsibilities part, not at a line count. A module past
# LONG_MODULE lines is reported (printed by the test below, `-s` shows it) with the one job it holds, which it must
# name here; a module that holds two jobs is split at that seam instead.
LONG_MODULE = 500
ONE_JOB: dict[str, str] = {
    "kvtransfer.eval.adapter": "the lm-eval model: the request types lm-eval calls, each through the same per-mode "
                               "prefix cache",
    "kvtransfer.serve.store": "the block store's format: keys, write, lookup, verified read, and the eviction, "
                              "retention and deletion that keep its chains whole",
    "kvtransfer.serve.connector": "vLLM's KV-connector hooks, scheduler and worker side, each turning any fault into a "
                                  "counted fallback",
    "kvtransfer.serve.proxy": "the proxy's routing of one request: source turn, switch or later turn, and its "
                              "fallbacks (session state and wire formats live in proxy_state / proxy_wire)",
    "kvtransfer.core.mapper": "the mapper artifacts (every kind's selected layers and maps) and their apply: blocks "
                              "from strided views, the dtype paths and the finiteness check",
}


def long_modules() -> dict[str, int]:
    return {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > LONG_MODULE}


def test_long_modules_are_reported_with_the_one_job_they_hold():
    long = long_modules()
    for name, n in sorted(long.items()):
        print(f"{name}: {n} lines -- {ONE_JOB.get(name, '(no job named: split it or name it in ONE_JOB)')}")
    assert sorted(set(long) - set(ONE_JOB)) == [], "a long module must name its one job in ONE_JOB (or be split)"


def test_the_core_imports_nothing_from_runner_eval_bench_plan_or_report():
    graph = import_graph()
    bad = {name: sorted(t for t in targets if _part(t) != "core")
           for name, targets in graph.items() if _part(name) == "core"}
    assert {k: v for k, v in bad.items() if v} == {}


def test_each_outer_part_builds_on_the_core_only_and_the_runner_joins_them():
    graph = import_graph()
    bad = {}
    for name, targets in graph.items():
        part = _part(name)
        if part == "core":
            continue
        allowed = {"core", part} | OUTER[part]
        wrong = sorted(t for t in targets if _part(t) not in allowed)
        if wrong:
            bad[name] = wrong
    assert bad == {}


def test_no_import_cycles_among_kvtransfer_modules():
    """Counting function-level imports too (see the module docstring)."""
    assert _cycles(import_graph()) == []


def test_the_command_line_entry_points_still_answer():
    """`python -m kvtransfer.bench` and `python -m kvtransfer.plan` keep working after the moves."""
    for module in ("kvtransfer.bench", "kvtransfer.plan"):
        done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"python -m {module}" in done.stdout


def _third_party(tree: ast.AST) -> set[str]:
    """Top-level names of the non-kvtransfer modules a file imports (anywhere in it)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out - {"kvtransfer"}


def test_serve_loads_without_the_harness_and_the_core_never_imports_it():
    """kvtransfer.serve (issue 22) runs inside vLLM's worker: core modules only -- no Hydra, lm-eval, W&B,
    runner or report -- and vLLM itself only in the connector, behind an ImportError guard; no core module
    imports serve."""
    graph = import_graph()
    serve = {name for name in MODULES if name == "kvtransfer.serve" or name.startswith("kvtransfer.serve.")}
    assert "kvtransfer.serve.connector" in serve
    for name in serve:
        assert {t for t in graph[name] if _part(t) not in ("core", "kvtransfer.serve")} == set(), name
        tree = ast.parse(MODULES[name].read_text())
        assert not _third_party(tree) & {"hydra", "omegaconf", "lm_eval", "wandb", "matplotlib", "pandas"}, name
        if name != "kvtransfer.serve.connector":
            assert "vllm" not in _third_party(tree), f"{name} imports vllm: only the connector may, guarded"
    guarded = [node for node in ast.walk(ast.parse(MODULES["kvtransfer.serve.connector"].read_text()))
               if isinstance(node, ast.Try) and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError"
                                                    for h in node.handlers)]
    assert any("vllm" in _third_party(t) for t in guarded), "the connector's vllm import is not ImportError-guarded"
    assert {name for name, targets in graph.items() if _part(name) == "core" and targets & serve} == set()
