"""Architecture rules of pyro_mpt/, checked on the source (AST), not by running it.

* No module imports another module's private (``_name``) names, at module level
  or inside a function: what modules share is public in the module that owns it.
* No import cycle among pyro_mpt's modules. Imports inside functions count as
  much as module-level ones: moving an import into a function hides a cycle
  from Python's import machinery, not from the design. Imports run one way:
  loss and evidence build on the engines (``conditionals``), which build on
  the tokens (``observed_tokens``) and the schedules (``masks``).
* Imports run one way through the layers (:data:`LAYERS`): tokens and
  schedules, engines, losses and evidence, applications.
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


# ---------------------------------------------------------------------- import cycles
def imported_modules(source, module, modules, is_package=False):
    """``{imported module: first line}`` for every import of one of ``modules``, at any depth.

    ``from m import x`` imports ``m.x`` when that is a module, else ``m``.

    :param str source: the module's source.
    :param str module: its dotted name (to resolve relative imports).
    :param set modules: the dotted names of the package's modules.
    :param bool is_package: it is a package's ``__init__``.
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = {}
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        for target in targets:
            if target in modules and target != module:
                found.setdefault(target, node.lineno)
    return found


def find_cycle(graph):
    """One import cycle ``[m1, m2, ..., m1]`` of ``graph`` (``{module: {imported: line}}``), or None."""
    state = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def import_graph(sources):
    """``{module: {imported module: line}}`` from ``{module: (source, is_package)}``."""
    modules = set(sources)
    return {m: imported_modules(src, m, modules, is_pkg) for m, (src, is_pkg) in sources.items()}


def _package_sources():
    return {
        _module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def test_the_check_finds_an_import_cycle_through_a_function_level_import():
    sources = {
        "pkg": ("from .evidence import Evidence\n", True),
        "pkg.evidence": ("from .engines import quadrature\nfrom . import sites\n", False),
        "pkg.engines": ("", True),
        "pkg.engines.quadrature": ("import math\n\ndef f():\n    from ..evidence import Result\n", False),
        "pkg.sites": ("import pkg.masks\n", False),
        "pkg.masks": ("", False),
    }
    graph = import_graph(sources)
    assert graph["pkg.evidence"] == {"pkg.engines.quadrature": 1, "pkg.sites": 2}
    assert graph["pkg.engines.quadrature"] == {"pkg.evidence": 4}
    assert graph["pkg.sites"] == {"pkg.masks": 1}
    assert find_cycle(graph) == ["pkg.evidence", "pkg.engines.quadrature", "pkg.evidence"]
    # without the function-level import the graph is acyclic
    sources["pkg.engines.quadrature"] = ("import math\n", False)
    assert find_cycle(import_graph(sources)) is None


def test_no_import_cycle_among_pyro_mpt_modules():
    graph = import_graph(_package_sources())
    assert len(graph) > 20  # the scan sees the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (module-level or inside a function): " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])
    ) + f" -> {cycle[-1]}"


# ---------------------------------------------------------------------- layers
#: pyro_mpt's layers, lowest first, by the name under ``pyro_mpt``: a module imports
#: only from its own layer and the ones below. Tokens and schedules know no engine,
#: engines know no loss, estimate or evidence. Modules not listed are not checked.
LAYERS = [
    ["token_layout", "site_checks", "token_site", "observed_tokens", "mask_bits", "mask_blocks", "mask_draws", "missing_tokens", "masks",
     "importance_weights", "guide_checks", "curve"],
    ["conditionals"],
    ["estimate", "loss", "evidence", "importance_weighted_elbo", "guide_elbo"],
    ["adapters", "experiments"],
]


def layer_violations(graph, layers=LAYERS):
    """``(module, line, imported)`` for every import of a module in a higher layer."""
    rank = {name: i for i, names in enumerate(layers) for name in names}

    def layer(module):
        parts = module.split(".")
        return rank.get(parts[1]) if len(parts) > 1 else None

    return [
        (m, line, t)
        for m, imports in sorted(graph.items())
        for t, line in sorted(imports.items())
        if layer(m) is not None and layer(t) is not None and layer(t) > layer(m)
    ]


def test_the_layer_check_finds_an_engine_importing_the_evidence():
    graph = {
        "pyro_mpt.conditionals.quadrature": {"pyro_mpt.observed_tokens": 3, "pyro_mpt.evidence.result": 9},
        "pyro_mpt.evidence": {"pyro_mpt.conditionals": 1},
        "pyro_mpt.masks": {"pyro_mpt.mask_blocks": 2, "pyro_mpt.newmodule": 4},
        "pyro_mpt.observed_tokens": {},
    }
    assert layer_violations(graph) == [("pyro_mpt.conditionals.quadrature", 9, "pyro_mpt.evidence.result")]


def test_imports_run_one_way_through_the_layers():
    bad = layer_violations(import_graph(_package_sources()))
    assert not bad, "imports against the layers (loss/evidence -> conditionals -> observed_tokens/masks):\n" + "\n".join(
        f"{m} (line {line}) imports {t}" for m, line, t in bad
    )


def documented_modules(text):
    """``{package path: {module file names}}`` from the layout tables of ``docs/architecture.md``.

    A table belongs to the last bold heading naming a package, e.g. ``**Engines: `pyro_mpt/conditionals/`**``.
    """
    import re

    found, package = {}, None
    for line in text.splitlines():
        heading = re.match(r"^\*\*.*`(pyro_mpt/[\w/]*)`\*\*\s*$", line)
        if heading:
            package = heading.group(1).rstrip("/")
            found.setdefault(package, set())
            continue
        row = re.match(r"^\|\s*`([\w.]+\.py)`\s*\|", line)
        if row and package:
            found[package].add(row.group(1))
    return found


def test_the_layout_check_reads_the_tables():
    text = "**Engines: `pyro_mpt/conditionals/`**\n\n| module | job |\n|---|---|\n| `base.py` | the base |\n"
    assert documented_modules(text) == {"pyro_mpt/conditionals": {"base.py"}}


def test_docs_architecture_has_one_row_per_module():
    # the page is "the truth" about the layout: a module added, moved or removed must change it too
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    documented = documented_modules(text)
    on_disk = {}
    for path in PACKAGE.rglob("*.py"):
        on_disk.setdefault(str(path.parent.relative_to(PACKAGE.parent)), set()).add(path.name)
    assert documented == on_disk, {
        pkg: {"undocumented": sorted(on_disk.get(pkg, set()) - documented.get(pkg, set())),
              "stale": sorted(documented.get(pkg, set()) - on_disk.get(pkg, set()))}
        for pkg in set(documented) | set(on_disk)
        if documented.get(pkg) != on_disk.get(pkg)
    }


def _docstrings_with_escapes(source):
    """Names of the docstrings of ``source`` that hold a control character: a
    backslash sequence such as ``\\t`` in ``:math:`R\\times R``` written in a
    docstring that is not raw turns into one, and the math renders wrong."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and any(ch in doc for ch in "\t\a\b\f\v\r"):
                found.append(getattr(node, "name", "<module>"))
    return found


def test_the_docstring_check_finds_an_escape():
    assert _docstrings_with_escapes('def f():\n    """:math:`R\\times R`"""\n') == ["f"]
    assert _docstrings_with_escapes('def f():\n    r""":math:`R\\times R`"""\n') == []


def test_no_docstring_holds_a_control_character():
    bad = {
        str(path.relative_to(PACKAGE)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if (names := _docstrings_with_escapes(path.read_text()))
    }
    assert not bad, f"docstrings with a backslash escape turned control character (write them raw, r'''...'''): {bad}"


def test_every_module_compiles_without_warnings():
    """No invalid escape sequences (a DeprecationWarning today, a SyntaxWarning in Python 3.12 and
    an error later): docstrings with ``:math:`` backslashes are raw strings."""
    import warnings

    for path in sorted(PACKAGE.rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(encoding="utf-8"), str(path), "exec")
