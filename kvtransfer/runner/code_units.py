"""The code an artifact kind reaches, at the granularity of functions (standard library only).

A *unit* is one piece of a kvtransfer module: a top-level function, a method (`Class.method`), a class body (its
bases, decorators and class-level assignments, without its methods), or the module body (every top-level statement
that is not a def, a class or an import). A kind reaches every unit of its entry modules (`Artifact.code`) and,
from each reached unit, what that unit names:

- a name bound by an import (anywhere in the module, function-level included) or defined in the module: that
  function or class (a package re-export is followed to its definition); a module named bare (passed as an object)
  counts as all of it, `module.attr` as that unit, an `importlib.import_module("kvtransfer.x")` string as all of x,
  a "kvtransfer.x:attr" string as that unit;
- `obj.attr` on anything else (an argument such as the `run` every stage receives): every method, property or
  class-level assignment named `attr` in the package, since the object's type is not known statically -- so an edit
  to `Run.native_sink` moves exactly the kinds whose code reads `.native_sink` somewhere along the way;
- `getattr(obj, "attr")` / `hasattr(obj, "attr")` with a literal name: as `obj.attr`.

Reaching a unit reaches its module's body (the constants and tables it reads at import), and reaching a class
reaches all of its methods (frameworks call some by name: `forward`, lm-eval's request methods). Dunder attributes
(`super().__init__`) are not matched by name: the class that owns them is reached through its bases.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

Unit = tuple[str, str]   # (module path relative to the package, "" | "f" | "C" | "C.m")


@dataclass
class Module:
    rel: str                                            # "runner/run.py"
    units: dict[str, ast.AST] = field(default_factory=dict)
    classes: dict[str, list[str]] = field(default_factory=dict)   # class -> its unit names (body + methods)
    imports: dict[str, tuple] = field(default_factory=dict)       # local name -> ("module", rel) | ("name", rel, n)
    external: set[str] = field(default_factory=set)               # names bound by imports of other packages


class Package:
    """The parsed kvtransfer package under `root` (the directory holding __init__.py)."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: dict[str, Module] = {}
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            self.modules[rel] = self._parse(rel, strip_docstrings(ast.parse(path.read_text(), str(path))))
        self.by_attr: dict[str, set[Unit]] = {}
        self._refs: dict[Unit, set[Unit]] = {}
        self._reach: dict[tuple, frozenset] = {}
        self.by_lower_class: dict[str, set[tuple[str, str]]] = {}
        for rel, mod in self.modules.items():
            for name in mod.units:
                if "." in name:
                    self.by_attr.setdefault(name.split(".", 1)[1], set()).add((rel, name))
            for cls in mod.classes:
                self.by_lower_class.setdefault(cls.lower(), set()).add((rel, cls))
            for cls, node in ((c, mod.units[c]) for c in mod.classes):
                for stmt in node.body:
                    for target in _assigned(stmt):
                        self.by_attr.setdefault(target, set()).add((rel, cls))

    # -- parsing ---------------------------------------------------------------------------------------------
    def module_rel(self, parts: list[str]) -> str | None:
        """The module file of dotted `parts` below the package (["core", "rope"] -> "core/rope.py")."""
        base = "/".join(parts)
        for cand in (f"{base}.py", f"{base}/__init__.py" if base else "__init__.py"):
            if (self.root / cand).is_file():
                return cand
        return None

    def _parse(self, rel: str, tree: ast.Module) -> Module:
        mod = Module(rel)
        package = rel.split("/")[:-1]
        body = []
        for stmt in tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mod.units[stmt.name] = stmt
            elif isinstance(stmt, ast.ClassDef):
                mod.units[stmt.name] = stmt
                mod.classes[stmt.name] = [stmt.name]
                for sub in stmt.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        mod.units[f"{stmt.name}.{sub.name}"] = sub
                        mod.classes[stmt.name].append(f"{stmt.name}.{sub.name}")
            elif not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                body.append(stmt)
        mod.units[""] = ast.Module(body=body, type_ignores=[])
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] != "kvtransfer":
                        mod.external.add(alias.asname or parts[0])
                        continue
                    if alias.asname:
                        if rel_ := self.module_rel(parts[1:]):
                            mod.imports[alias.asname] = ("module", rel_)
                    else:
                        mod.imports["kvtransfer"] = ("module", "__init__.py")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                elif (node.module or "").split(".")[0] == "kvtransfer":
                    base = node.module.split(".")[1:]
                else:
                    mod.external.update(alias.asname or alias.name for alias in node.names)
                    continue
                for alias in node.names:
                    local = alias.asname or alias.name
                    if sub := self.module_rel(base + [alias.name]):
                        mod.imports[local] = ("module", sub)
                    elif owner := self.module_rel(base):
                        mod.imports[local] = ("name", owner, alias.name)
        return mod

    # -- resolution ------------------------------------------------------------------------------------------
    def resolve(self, rel: str, name: str, depth: int = 0) -> set[Unit]:
        """The units `name` means in module `rel` (its definition, following re-exports), or all of a module."""
        mod = self.modules.get(rel)
        if mod is None or depth > 20:
            return set()
        if name in mod.units and name:
            return {(rel, name)}
        bound = mod.imports.get(name)
        if bound is None:
            return set()
        if bound[0] == "module":
            return self.whole(bound[1])
        return self.resolve(bound[1], bound[2], depth + 1) or self.whole_if_module(bound[1], bound[2])

    def whole_if_module(self, rel: str, name: str) -> set[Unit]:
        sub = self.module_rel(rel.removesuffix("__init__.py").removesuffix(".py").strip("/").split("/") + [name]) \
            if rel != "__init__.py" else self.module_rel([name])
        return self.whole(sub) if sub else set()

    def whole(self, rel: str) -> set[Unit]:
        return {(rel, u) for u in self.modules[rel].units}

    def module_of(self, rel: str, node: ast.AST) -> str | None:
        """The module an expression names in `rel` (`tables`, `kvtransfer.core.data`), else None."""
        if isinstance(node, ast.Name):
            bound = self.modules[rel].imports.get(node.id)
            return bound[1] if bound and bound[0] == "module" else None
        if isinstance(node, ast.Attribute):
            base = self.module_of(rel, node.value)
            if base is None:
                return None
            dotted = base.removesuffix("/__init__.py").removesuffix("__init__.py").removesuffix(".py")
            return self.module_rel([p for p in dotted.split("/") if p] + [node.attr])
        return None

    def references(self, unit: Unit) -> set[Unit]:
        """The units `unit`'s code names (see the module docstring); computed once per unit."""
        if unit not in self._refs:
            self._refs[unit] = self._references(unit)
        return self._refs[unit]

    def _references(self, unit: Unit) -> set[Unit]:
        rel, name = unit
        mod = self.modules[rel]
        node = mod.units[name]
        if name in mod.classes:   # the class body: bases, decorators, keywords and non-method statements only
            node = ast.ClassDef(name=node.name, bases=node.bases, keywords=node.keywords, decorator_list=node.decorator_list,
                                body=[s for s in node.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))],
                                type_params=[])
        out: set[Unit] = {(rel, "")}
        bases = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and id(sub) not in bases:
                out |= self.resolve(rel, sub.id)
            elif isinstance(sub, ast.Attribute):
                owner = self.module_of(rel, sub.value)
                if owner is not None:
                    out |= self.resolve(owner, sub.attr) or self.whole_if_module(owner, sub.attr)
                    continue
                if isinstance(sub.value, ast.Name) and id(sub.value) in bases:
                    out |= self.resolve(rel, sub.value.id) if sub.value.id in mod.units else set()
                out |= self.attribute(unit, sub.value, sub.attr)
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in ("getattr", "hasattr") \
                    and len(sub.args) >= 2 and isinstance(sub.args[1], ast.Constant) and isinstance(sub.args[1].value, str):
                out |= self.by_attr.get(sub.args[1].value, set())
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value.startswith("kvtransfer."):
                target, _, attr = sub.value.partition(":")
                if target_rel := self.module_rel(target.split(".")[1:]):
                    out |= self.resolve(target_rel, attr) if attr else self.whole(target_rel)
        return out

    def attribute(self, unit: Unit, receiver: ast.AST, attr: str) -> set[Unit]:
        """The units `receiver.attr` may mean. On `self` in a method of class C: C's own `attr` (an inherited one
        comes with the base class, reached in full through C's bases). On a name bound by another package's import
        (`torch.save`): none. Otherwise the receiver is an object of a class the kind either reaches by name (then
        all of that class is reached already) or is handed: the `HANDED_IN` classes (the `run` every stage
        receives), whose method, property or class-level assignment `attr` it then is -- unless `attr` is a
        builtin or tensor method name (`split`, `get`, `to`) on a receiver not named after the class. Dunders
        never match."""
        if attr.startswith("__") and attr.endswith("__"):
            return set()
        rel, name = unit
        matches = self.by_attr.get(attr, set())
        if isinstance(receiver, ast.Name):
            if receiver.id in self.modules[rel].external and receiver.id not in self.modules[rel].units:
                return set()   # torch.save, np.load, json.dumps: another package's function
            if receiver.id == "self" and "." in name:
                cls = name.split(".")[0]
                return {u for u in matches if u[0] == rel and (u[1] == cls or u[1].startswith(cls + "."))}
            named = {c for c in HANDED_IN if c[1].lower() == receiver.id}
            if named:
                return {u for u in matches if (u[0], u[1].split(".")[0]) in named}
        if attr in NOT_PACKAGE_ATTRIBUTES:
            return set()
        return {u for u in matches if (u[0], u[1].split(".")[0]) in HANDED_IN}

    def reach(self, entries: tuple[str, ...]) -> frozenset[Unit]:
        """Every unit reachable from all units of the entry modules ("runner/fit_stage", ...)."""
        if tuple(entries) not in self._reach:
            self._reach[tuple(entries)] = frozenset(self._reach_from(entries))
        return self._reach[tuple(entries)]

    def _reach_from(self, entries: tuple[str, ...]) -> set[Unit]:
        todo: list[Unit] = []
        for entry in entries:
            rel = f"{entry}.py"
            if rel not in self.modules:
                raise FileNotFoundError(f"{self.root / rel} is declared as producing code but does not exist: fix "
                                        "Artifact.code")
            todo += self.whole(rel)
        seen: set[Unit] = set()
        while todo:
            unit = todo.pop()
            if unit in seen:
                continue
            seen.add(unit)
            rel, name = unit
            if name in self.modules[rel].classes:   # a class reached: all of its methods
                todo += [(rel, m) for m in self.modules[rel].classes[name]]
            todo += self.references(unit)
        return seen

    def source(self, unit: Unit) -> str:
        """The unit's code without docstrings, comments or layout (a class body: without its methods)."""
        rel, name = unit
        node = self.modules[rel].units[name]
        if name in self.modules[rel].classes:
            node = ast.ClassDef(name=node.name, bases=node.bases, keywords=node.keywords, decorator_list=node.decorator_list,
                                body=[s for s in node.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
                                or [ast.Pass()], type_params=[])
        return ast.unparse(node)   # docstrings were stripped at parse


# The classes whose instances a stage is handed rather than makes: `Run` (runner/run.py), built by the pipeline and
# passed to every stage. Their methods are reached by the attribute names the reached code reads.
HANDED_IN = frozenset({("runner/run.py", "Run")})

# Attribute names whose receiver, when it is not `self` or a class-named variable, is taken to be a builtin value or a
# tensor: methods of str, bytes, list, dict, set and tuple, and the common torch.Tensor / nn.Module ones.
NOT_PACKAGE_ATTRIBUTES = frozenset(
    {n for t in (str, bytes, list, dict, set, tuple, int, float) for n in dir(t) if not n.startswith("_")}
    | {"to", "view", "reshape", "float", "double", "half", "bfloat16", "mean", "sum", "chunk", "size", "shape",
       "transpose", "permute", "contiguous", "unsqueeze", "squeeze", "expand", "repeat", "clone", "detach", "cpu",
       "cuda", "numpy", "item", "tolist", "matmul", "norm", "std", "var", "max", "min", "argmax", "argmin", "sort",
       "topk", "gather", "scatter", "masked_fill", "flatten", "narrow", "t", "T", "abs", "exp", "log", "sqrt", "pow",
       "add", "sub", "mul", "div", "type", "dtype", "device", "numel", "dim", "new_zeros", "new_ones", "zero_",
       "fill_", "copy_", "add_", "mul_", "div_", "sub_", "clamp", "long", "int", "bool", "all", "any", "eq", "ne",
       "lt", "gt", "le", "ge", "cumsum", "softmax", "log_softmax", "backward", "requires_grad_", "to_dict",
       "exists", "is_file", "is_dir", "read_text", "write_text", "mkdir", "open", "name", "stem", "suffix", "parent",
       "with_suffix", "with_name", "glob", "rglob", "iterdir", "unlink", "stat", "resolve", "relative_to"})


def _assigned(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


def strip_docstrings(tree: ast.AST) -> ast.AST:
    """`tree` with every module, class and function docstring removed (in place): docstrings never move a digest."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree

