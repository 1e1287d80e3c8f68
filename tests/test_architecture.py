"""Architecture rules of pyro_mpt/, checked on the source (AST), not by running it.

* No module imports another module's private (``_name``) names, at module level
  or inside a function: what modules share is public in the module that owns it.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pyro_mpt"


def _module_name(path):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def private_imports(source, module, is_package=False):
    """``(line, imported module, name)`` for every ``from m import _name`` of another module.

    :param str source: the module's source.
    :param str module: its dotted name (to resolve relative imports).
    :param bool is_package: it is a package's ``__init__``.
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            name = alias.name
            if name.startswith("_") and not name.startswith("__") and target != module:
                found.append((node.lineno, target, name))
    return found


def _violations():
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for line, target, name in private_imports(
            path.read_text(encoding="utf-8"), module, path.name == "__init__.py"
        ):
            out.append(f"{path.relative_to(PACKAGE.parent)}:{line}: from {target} import {name}")
    return out


def test_the_check_finds_a_private_import():
    bad = (
        "from .gaussian_marginal import _unwrap, gaussian_marginal\n"
        "def f():\n"
        "    from ..evidence import _helper\n"
        "    from . import public\n"
        "    from .x import __version__\n"
    )
    found = private_imports(bad, "pyro_mpt.conditionals.quadrature")
    assert found == [
        (1, "pyro_mpt.conditionals.gaussian_marginal", "_unwrap"),
        (3, "pyro_mpt.evidence", "_helper"),
    ]
    # a package's __init__ resolves '.' to itself
    assert private_imports("from .base import _x", "pyro_mpt.conditionals", True) == [
        (1, "pyro_mpt.conditionals.base", "_x")
    ]


def test_no_module_imports_another_modules_private_names():
    bad = _violations()
    assert not bad, "private names imported across modules (make them public where they belong):\n" + "\n".join(bad)
