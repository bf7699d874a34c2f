"""Every public name has an example in its docstring, and every example runs."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import otreg

pytest.importorskip("pyvista")
pytest.importorskip("nilearn")

#: the namespaces a user imports from, and the public names each must document by example
NAMESPACES = (
    "otreg",
    "otreg.loops",
    "otreg.datasets",
    "otreg.viz",
    "otreg.registration",
    "otreg.ot",
    "otreg.reductions",
    "otreg.batch",
    "otreg.io",
    "otreg.costs",
    "otreg.shapes",
)


def _public_modules() -> list[str]:
    names = ["otreg"]
    for info in pkgutil.walk_packages(otreg.__path__, "otreg."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            names.append(info.name)
    return names


def _documented_objects() -> list[tuple[str, object]]:
    out = []
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                out.append((f"{namespace}.{name}", obj))
    return out


@pytest.mark.parametrize(
    "qualified, obj", [pytest.param(q, o, id=q) for q, o in _documented_objects()]
)
def test_public_name_has_a_docstring_with_an_example(qualified, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{qualified} has no docstring"
    assert ">>>" in doc, f"{qualified}'s docstring has no example"


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests, seen = [], set()
    for name in _public_modules():
        module = importlib.import_module(name)
        for test in finder.find(module):
            if test.examples and test.name not in seen and not test.name.startswith("otreg._"):
                seen.add(test.name)
                tests.append(test)
    # names re-exported from private modules (otreg._checks.FoldWarning...) run once too
    for qualified, obj in _documented_objects():
        for test in finder.find(obj, name=qualified):
            key = f"{obj.__module__}.{obj.__qualname__}"
            if test.examples and key not in seen and test.name not in seen:
                seen.update((key, test.name))
                tests.append(test)
    return sorted(tests, key=lambda t: t.name)


@pytest.mark.parametrize("test", _examples(), ids=lambda t: t.name)
def test_example_runs(test, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    out: list[str] = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)
