"""The package's layout rules, read from the source: imports go one way (no module imports a
module that imports it back, function-level imports included), pykeops is imported in one
module only, and private modules or names are imported only inside their own package."""

import ast
import re
from pathlib import Path

import otreg

ROOT = Path(otreg.__file__).parent


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path):
    """(imported module, imported names) for every import in the file, relative ones
    resolved."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base, [alias.name for alias in node.names]


def graph():
    mods = modules()
    edges = {m: set() for m in mods}
    for name, path in mods.items():
        for target, names in imports(name, path):
            for candidate in [f"{target}.{n}" for n in names] + [target]:
                if candidate in mods and candidate != name:
                    edges[name].add(candidate)
                    break
    return edges


def package_of(module: str) -> str:
    return (
        module
        if (ROOT.parent / module.replace(".", "/") / "__init__.py").exists()
        else module.rsplit(".", 1)[0]
    )


def test_no_import_cycles():
    edges = graph()
    # a package's __init__ re-exports its modules; a module importing its own package's
    # __init__ (or a parent's) for a sibling is the only way up, so ignore edges to parents
    for name in edges:
        edges[name] = {t for t in edges[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_multiscale_does_not_import_the_loop():
    edges = graph()["otreg.ot.multiscale"]
    assert "otreg.ot.solver" not in edges and "otreg.ot.loop" not in edges


def test_pykeops_is_imported_in_one_module():
    users = {
        name
        for name, path in modules().items()
        for target, _ in imports(name, path)
        if target.split(".")[0] == "pykeops"
    }
    assert users == {"otreg.reductions._keops"}


def test_private_names_stay_inside_their_package():
    """(``otreg._checks`` serves every subpackage; ``otreg.io._files`` only ``otreg.io``.)"""
    crossing = []
    for name, path in modules().items():
        for target, names in imports(name, path):
            if not target.startswith("otreg"):
                continue
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            hidden_module = any(part.startswith("_") for part in target.split(".")[1:])
            owner, user = package_of(target), package_of(name)
            # a package's private parts serve that package and the packages inside it
            if (private or hidden_module) and user != owner and not user.startswith(owner + "."):
                crossing.append(f"{name} imports {target} {private}")
    assert not crossing, crossing


def test_every_public_name_is_exported_and_exists():
    for module in (
        otreg,
        otreg.ot,
        otreg.reductions,
        otreg.loops,
        otreg.registration,
        otreg.datasets,
        otreg.io,
    ):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_only_checks_and_info_are_private_at_the_root():
    private = sorted(
        p.name for p in ROOT.glob("_*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert private == ["_checks.py", "_info.py"]


def test_no_function_level_import_of_otreg():
    """Importing any otreg module runs otreg/__init__ first, which loads every package:
    a function-level import of otreg defers nothing (heavy optional libraries stay
    imported on use)."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.ImportFrom) and (
                        sub.level or (sub.module or "").split(".")[0] == "otreg"
                    ):
                        found.append(f"{name}:{sub.lineno}")
    assert not found, found


#: exported submodules: namespaces whose own __all__ is their API
NAMESPACE_MODULES = {"otreg.registration.metrics"}


def test_module_all_holds_only_its_packages_exports():
    """One public/private rule: a package's __init__ exports are its API, and a module's
    __all__ names only those of its package's exports that it defines."""
    import importlib

    extra = {}
    for name, path in modules().items():
        if path.name in ("__init__.py", "__main__.py") or name in NAMESPACE_MODULES:
            continue
        module = importlib.import_module(name)
        package = importlib.import_module(package_of(name))
        names = set(getattr(module, "__all__", ()))
        if names - set(package.__all__):
            extra[name] = sorted(names - set(package.__all__))
    assert not extra, extra


def test_the_api_page_documents_the_exports_and_nothing_internal():
    page = (ROOT.parent / "docs" / "api.md").read_text()
    documented = set(re.findall(r"\.\. automodule:: (otreg[\w.]*)", page))
    packages = {name for name, path in modules().items() if path.name == "__init__.py"} - {
        "otreg.cli"
    }
    assert documented == packages | NAMESPACE_MODULES


REMOVED = {"strategy", "memory", "truncate", "cluster_scale"}


def test_no_deprecated_parameter_remains():
    import inspect

    for fn in (otreg.sinkhorn, otreg.sinkhorn_divergence, otreg.SinkhornLoss, otreg.register):
        params = inspect.signature(fn).parameters
        assert not REMOVED & set(params), fn
    register = inspect.signature(otreg.register).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in register.values())
    lddmm = {"sigma", "control_points", "n_steps", "integrator", "regularization"}
    assert not (lddmm | {"max_iter", "tol", "reach"}) & set(register)
