"""Sphinx configuration of the pyro_mpt documentation.

Build with ``make docs`` (or ``python -m sphinx -W --keep-going -b html docs
docs/_build/html``). The build needs no network: no intersphinx, no remote
images. Warnings are errors in CI, so every reference below must resolve.
"""

import argparse
import importlib
import os
import sys

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

# autodoc imports the package from this checkout, not from an installed copy
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import pyro_mpt  # noqa: E402

project = "pyro_mpt"
author = "pyro_mpt contributors"
copyright = "pyro_mpt contributors"
version = release = pyro_mpt.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# RESULTS.md is included by gallery/index.md; snippets/ holds code shown by literalinclude
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "gallery/RESULTS.md", "snippets"]
templates_path = []

# MyST: $...$ / $$...$$ math in the Markdown pages, heading anchors for links
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

# autodoc: Pyro's reST docstrings (:param x:, :returns:, :math:), source order
autodoc_member_order = "bysource"
# "members" is given per directive: a default of True would override explicit member lists
autodoc_default_options = {"show-inheritance": True}
autodoc_typehints = "none"
autodoc_preserve_defaults = True
# optional dependencies are imported lazily by pyro_mpt; nothing to mock

# Every cross-reference inside pyro_mpt must resolve; references to other
# projects (torch, pyro, numpy, the Python builtins named in :param type:
# fields) cannot, since the build runs offline without intersphinx.
nitpicky = True
_EXTERNAL = (
    r"(torch|pyro|numpy|np|scipy|arviz|matplotlib|transformers|datasets|accelerate|"
    r"tqdm|PIL|argparse|collections|typing|dataclasses|abc|enum|random|os|pathlib|io|json)(\..*)?"
)
_BUILTINS = (
    r"int|float|str|bool|bytes|list|dict|tuple|set|callable|object|type|None|"
    r"Exception|ValueError|TypeError|RuntimeError|ImportError|UserWarning|Warning|"
    r"optional|iterable|sequence|mapping|generator|Path|os\.PathLike|.*\bor\b.*"
)
nitpick_ignore_regex = [
    (r"py:.*", _EXTERNAL),
    (r"py:.*", _BUILTINS),
]

html_theme = "alabaster"
html_title = f"pyro_mpt {release}"
html_static_path = []
html_theme_options = {
    "description": "Masked pre-training as a training objective and evidence estimator for Pyro",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "240px",
}
html_sidebars = {"**": ["about.html", "navigation.html", "relations.html", "searchbox.html"]}


def _canonical(target):
    """``pyro_mpt.X.attr`` -> the name under the module that defines ``X`` (a class or function).

    The package re-exports its main classes (``pyro_mpt.MaskedPretrainingLoss``
    is ``pyro_mpt.loss.MaskedPretrainingLoss``); the API pages document each
    object once, where it is defined, and this maps the short names to it.
    """
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        rest = parts[i:]
        for j, name in enumerate(rest):
            if not hasattr(obj, name):
                return None
            attr = getattr(obj, name)
            module = getattr(attr, "__module__", None)
            qual = getattr(attr, "__qualname__", None)
            if module and qual and module.startswith("pyro_mpt") and callable(attr):
                return ".".join([module, qual, *rest[j + 1 :]])
            obj = attr
        return None
    return None


def _resolve_reexport(app, env, node, contnode):
    """Resolve references to re-exported names, absolute or relative to the current module."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "").lstrip(".~")
    modname, classname = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if modname and not target.startswith("pyro_mpt."):
        if classname:
            candidates.append(f"{modname}.{classname}.{target}")
        candidates.append(f"{modname}.{target}")
    domain = env.domains["py"]
    for candidate in candidates:
        if not candidate.startswith("pyro_mpt."):
            continue
        canonical = _canonical(candidate)
        if canonical is None or canonical == node.get("reftarget"):
            continue
        new = node.deepcopy()
        new["reftarget"] = canonical
        found = domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], canonical, new, contnode)
        if found is not None:
            return found
    # ``Class.member`` written without its module: resolve it when exactly one
    # documented object has that dotted suffix
    if "." in target:
        matches = [name for name in domain.objects if name.endswith("." + target)]
        if len(matches) == 1:
            new = node.deepcopy()
            new["reftarget"] = matches[0]
            return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], matches[0], new, contnode)
    return None


class CommandHelp(SphinxDirective):
    """``.. pyro-mpt-help:: [SUBCOMMAND]``: the ``--help`` text of ``pyro-mpt``, read from the parser.

    The CLI page shows the parser's own help, so it cannot drift from the code.
    """

    optional_arguments = 1

    def run(self):
        from pyro_mpt.experiments.cli import build_parser

        old = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "88"  # argparse wraps at the terminal width
        try:
            parser = build_parser()
            if self.arguments:
                sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
                parser = sub.choices[self.arguments[0]]
            text = parser.format_help()
        finally:
            if old is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = old
        node = nodes.literal_block(text, text)
        node["language"] = "text"
        return [node]


class GalleryThumbnails(SphinxDirective):
    """``.. gallery-thumbnails::``: every PNG next to the current page, as linked thumbnails.

    Globbing keeps the gallery page complete when ``make gallery`` (or a new
    gallery script) adds figures; each thumbnail links to the full image.
    """

    def run(self):
        folder = os.path.dirname(self.env.doc2path(self.env.docname))
        names = sorted(f for f in os.listdir(folder) if f.endswith(".png"))
        para = nodes.paragraph()
        for name in names:
            self.env.note_dependency(os.path.join(folder, name))
            para += nodes.image(uri=name, alt=name, width="32%")
            para += nodes.Text(" ")
        listing = nodes.paragraph(text="Figures: " + ", ".join(names) + ".")
        return [para, listing]


def setup(app):
    app.add_directive("gallery-thumbnails", GalleryThumbnails)
    app.connect("missing-reference", _resolve_reexport)
    app.add_directive("pyro-mpt-help", CommandHelp)
