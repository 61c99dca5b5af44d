"""Every public name has a docstring, in one style (Google's), that documents what it takes and gives.

The public names are those the API reference (docs/api/) shows: each public module's ``__all__`` (and the
lazily built names it lists), and the public methods and properties each public class defines itself. For
a function or method of ours, every parameter is under ``Args:``, a ``return <value>`` in its body needs
``Returns:`` (or ``Yields:``), and a ``raise`` in its body needs ``Raises:``. A method that overrides a base
class's (DeepSpeed's engine, Accelerate's Accelerator, Lightning's strategies) takes its parameters from the
base class and needs a docstring saying what it does here; its sections are checked where it has them.
"""
import ast
import importlib
import inspect
import re
import textwrap

import pytest

MODULES = {
    "deepspeed_multi": None,
    "deepspeed_multi.accelerate": "accelerate",
    "deepspeed_multi.transformers": "transformers",
    "deepspeed_multi.lightning": "lightning",
}
SECTION = re.compile(r"^(Args|Arguments|Returns|Yields|Raises|Example|Examples|Note|Notes|Attributes):\s*$", re.M)


def _public(module_name):
    """(qualified name, object, owner class or None) for every public name of the module."""
    module = importlib.import_module(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.ismodule(obj) and inspect.isfunction(getattr(obj, name, None)):
            obj = getattr(obj, name)  # a callable module (deepspeed_multi.report): its function of that name
        if isinstance(obj, (tuple, list, dict, str, int)):
            continue  # data (e.g. lightning.TESTED): documented in the module's docstring
        yield f"{module_name}.{name}", obj, None
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, value in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if inspect.isfunction(value) or isinstance(value, property):
                    yield f"{module_name}.{name}.{attr}", value, obj


def _sections(doc):
    """{section name: its text} of a Google-style docstring."""
    found, parts = {}, SECTION.split(doc)
    for i in range(1, len(parts) - 1, 2):
        found[parts[i]] = parts[i + 1]
    return found


def _documented_args(text):
    return {m.group(1).lstrip("*") for m in re.finditer(r"^\s{2,}(\*{0,2}\w+)(?:\s*\([^)]*\))?:", text, re.M)}


def _body_uses(fn):
    """(returns a value, raises) in the function's own body (nested functions and classes excluded)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):
        return False, False
    top = tree.body[0]
    returns = raises = False
    stack = list(ast.iter_child_nodes(top))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            returns = True
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            returns = True
        if isinstance(node, ast.Raise) and node.exc is not None:
            raises = True
        stack.extend(ast.iter_child_nodes(node))
    return returns, raises


def _overrides(owner, attr):
    return any(attr in vars(base) for base in owner.__mro__[1:] if base is not object)


def _problems(qualname, obj, owner):
    if isinstance(obj, property):
        return [] if (obj.fget and obj.fget.__doc__ and obj.fget.__doc__.strip()) else [f"{qualname}: no docstring"]
    doc = inspect.getdoc(obj) if not inspect.isclass(obj) else obj.__doc__
    if not doc or not doc.strip():
        return [f"{qualname}: no docstring"]
    if inspect.isclass(obj) or not callable(obj):
        return []
    doc = inspect.cleandoc(doc)
    sections = _sections(doc)
    override = owner is not None and _overrides(owner, obj.__name__)
    problems = []
    fn = inspect.unwrap(obj)
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
    except (TypeError, ValueError):
        params = []
    if params and (not override or "Args" in sections):
        documented = _documented_args(sections.get("Args", sections.get("Arguments", "")))
        missing = [p.name for p in params if p.name not in documented]
        if missing:
            problems.append(f"{qualname}: parameter(s) {missing} not under Args:")
    returns, raises = _body_uses(fn)
    if returns and not override and not ({"Returns", "Yields"} & set(sections)):
        problems.append(f"{qualname}: returns a value but has no Returns: section")
    if raises and not override and "Raises" not in sections:
        problems.append(f"{qualname}: raises but has no Raises: section")
    return problems


@pytest.mark.parametrize("module_name", list(MODULES))
def test_public_names_are_documented(module_name):
    needs = MODULES[module_name]
    if needs:
        pytest.importorskip(needs)
    problems = [p for q, o, c in _public(module_name) for p in _problems(q, o, c)]
    assert not problems, f"{len(problems)} documentation problem(s):\n" + "\n".join(problems)


def test_the_checker_catches_what_it_should():
    def good(a, b=1):
        """Add.

        Args:
            a (int): one.
            b: the other.

        Returns:
            The sum.

        Raises:
            ValueError: never.
        """
        if a is None:
            raise ValueError("a")
        return a + b

    def bad(a, b=1):
        """Add, with nothing said about a, b, the result or the error."""
        if a is None:
            raise ValueError("a")
        return a + b

    assert _problems("good", good, None) == []
    assert len(_problems("bad", bad, None)) == 3
    assert _problems("none", lambda: None, None) == ["none: no docstring"]
