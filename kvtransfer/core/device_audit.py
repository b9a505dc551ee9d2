"""Device discipline: every tensor kvtransfer creates is made on the device of the tensors it meets.

A tensor factory called without `device=` lands on the default device (the CPU), so a harness tested only on
CPUs hides each such call until a GPU run meets it ("Expected all tensors to be on the same device"). Two
checks find them while everything still runs on a CPU:

    lint_package()   the source: every `torch.<factory>(...)` and `torch.Generator(...)` call in kvtransfer/
                     that names no device (static; sees code no test runs, and Generators, which are no
                     torch function)
    DeviceAudit      a TorchFunctionMode that records each factory call made from a kvtransfer frame without
                     `device=`, and each seeded draw whose Generator sits on another device than the tensor
                     it fills (dynamic; sees what the lint cannot name, e.g. a factory behind a lambda)

Where the CPU is right (file I/O, host-side bookkeeping such as row orders and layer indices, a seeded draw
moved to the device afterwards so every device gets the same numbers), the call's first line carries a
trailing comment `# device: <reason>`; both checks accept it.
"""
from __future__ import annotations

import ast
import functools
import linecache
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

PACKAGE = Path(__file__).resolve().parents[1]   # kvtransfer/
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)

# torch functions that create a tensor on the default device unless told otherwise (*_like inherit the device of
# their argument, from_numpy / frombuffer share host memory and take no device)
FACTORIES = frozenset({
    "empty", "zeros", "ones", "full", "arange", "range", "linspace", "logspace", "eye", "empty_strided",
    "rand", "randn", "randint", "randperm", "normal", "tensor", "as_tensor", "scalar_tensor",
    "tril_indices", "triu_indices"})
_FACTORY_FUNCS = {getattr(torch, name): name for name in FACTORIES if hasattr(torch, name)}
_ANNOTATION = re.compile(r"#\s*device:\s*\S")


def annotated(line: str) -> bool:
    """Whether a source line carries the `# device: <reason>` annotation (a non-empty reason)."""
    return bool(_ANNOTATION.search(line))


@dataclass(frozen=True)
class Finding:
    """One creation without a device: file (path as given), 1-based line, the torch callable's name, why."""

    file: str
    line: int
    call: str
    problem: str = "names no device"

    def __str__(self) -> str:
        shown = Path(self.file)
        if shown.is_absolute() and shown.is_relative_to(PACKAGE.parent):
            shown = shown.relative_to(PACKAGE.parent)   # kvtransfer/...: the path a reader opens
        return f"{shown}:{self.line}: torch.{self.call}(...) {self.problem}: " \
               f"{linecache.getline(self.file, self.line).strip()}"


def _torch_call(node: ast.AST) -> str | None:
    """'zeros' for a call `torch.zeros(...)`, 'Generator' for `torch.Generator(...)`, else None."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch":
        if f.attr in FACTORIES or f.attr == "Generator":
            return f.attr
    return None


@functools.lru_cache(maxsize=None)
def _calls(path: str) -> tuple[tuple[int, int, str, bool], ...]:
    """(first line, last line, name, names a device) of every torch factory / Generator call in a file."""
    source = Path(path).read_text()
    out = []
    for node in ast.walk(ast.parse(source, filename=path)):
        name = _torch_call(node)
        if name is not None:
            # a `**kwargs` may carry the device: counted as naming one (the audit still sees the call)
            has_device = any(k.arg in ("device", None) for k in node.keywords)
            out.append((node.lineno, node.end_lineno or node.lineno, name, has_device))
    return tuple(sorted(out))


def lint_file(path: str | Path) -> list[Finding]:
    """The torch factory and Generator calls of one Python file that name no device and carry no annotation."""
    path = str(path)
    return [Finding(path, first, name) for first, _, name, has_device in _calls(path)
            if not has_device and not annotated(linecache.getline(path, first))]


def lint_package(root: str | Path = PACKAGE) -> list[Finding]:
    """`lint_file` over every .py file under `root` (default: the kvtransfer package), in path order."""
    return [f for path in sorted(Path(root).rglob("*.py")) for f in lint_file(path)]


def _caller(frame) -> tuple[str, int] | None:
    """(file, line) of the first frame outside torch and this module, or None (no Python caller)."""
    here = str(Path(__file__).resolve())
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and name != here and name != __file__:
            return name, frame.f_lineno
        frame = frame.f_back
    return None


def _call_annotated(path: str, line: int, name: str) -> bool:
    """Whether the `torch.<name>(` call executing at `line` carries the annotation: on its first line (the lint's
    rule) for a call spanning several lines, else on `line` itself."""
    if annotated(linecache.getline(path, line)):
        return True
    try:
        calls = _calls(path)
    except (OSError, SyntaxError):
        return False
    return any(annotated(linecache.getline(path, first)) for first, last, n, _ in calls
               if n == name and first <= line <= last)


class DeviceAudit(TorchFunctionMode):
    """Records (`findings`, each a `Finding`) every torch factory that code under `package` calls with no
    `device=` and no annotation, and every one whose `generator=` sits on another device than the tensor it
    makes. Use as a context manager around the code to audit; it changes no result."""

    def __init__(self, package: str | Path = PACKAGE):
        super().__init__()
        self.package = str(Path(package).resolve())
        self.findings: list[Finding] = []
        self.calls = 0   # factory calls seen from the package, flagged or not (a test can tell it ran)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _FACTORY_FUNCS.get(func)
        if name is None:
            return out
        where = _caller(sys._getframe(1))
        if where is None or not where[0].startswith(self.package):
            return out
        self.calls += 1
        path, line = where
        problem = None
        gen = kwargs.get("generator")
        if "device" not in kwargs:
            problem = "names no device"
        elif isinstance(gen, torch.Generator) and isinstance(out, torch.Tensor) and gen.device.type != out.device.type:
            problem = f"draws with a {gen.device.type} Generator into a {out.device.type} tensor"
        if problem and not _call_annotated(path, line, name):
            self.findings.append(Finding(path, line, name, problem))
        return out

    def report(self) -> str:
        """The findings, one `file:line: ...` line each, duplicates (a call site run many times) once."""
        return "\n".join(dict.fromkeys(str(f) for f in self.findings))
