"""Every user-facing error and warning of pyro_mpt: one row each in docs/errors.md, one trigger each here.

``docs/errors.md`` is the source of truth for the expected exception type and
message: each row's message cell holds fragments of the real message,
separated by `` … ``, that must appear in it in order. :func:`test_table_and_triggers_are_in_sync`
keeps the table and :data:`TRIGGERS` one-to-one, and :func:`test_every_message_in_the_code_has_a_row`
checks that every exception or warning message written in pyro_mpt/ is produced by some
trigger, or is an internal one listed in :data:`INTERNAL`.
"""

import ast
import re
import warnings
from pathlib import Path

import pytest
import pyro

import pyro_mpt
import pyro_mpt.experiments.compare
import pyro_mpt.experiments.datasets
import pyro_mpt.masks
import pyro_mpt.experiments.vae


from error_triggers import TRIGGERS


from error_triggers.common import TMP_BASE

ERRORS_MD = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


@pytest.fixture(autouse=True)
def _tmp_base(tmp_path):
    TMP_BASE["base"] = tmp_path  # triggers take no arguments; their files go under pytest's tmp_path
    yield
    TMP_BASE.clear()


# ---------------------------------------------------------------------- the table
def _table_rows():
    """Rows ``(id, type, message)`` of the tables in docs/errors.md whose first cell is an id."""
    rows = []
    for line in ERRORS_MD.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if not re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            continue  # e.g. the internal errors, listed by where they are raised
        row_id = cells[0].strip("`")
        kind = cells[1].strip("`")
        message = cells[-1].strip().strip("`").replace("\\|", "|")
        rows.append((row_id, kind, message))
    return rows


ROWS = _table_rows()


def test_table_and_triggers_are_in_sync():
    ids = [r[0] for r in ROWS]
    assert len(ids) == len(set(ids)), "duplicate ids in docs/errors.md"
    assert set(ids) - set(TRIGGERS) == set(), "rows of docs/errors.md without a trigger here"
    assert set(TRIGGERS) - set(ids) == set(), "triggers here without a row in docs/errors.md"


def _fragments_pattern(message):
    return ".*".join(re.escape(f.strip()) for f in message.split("…"))


_OUTCOMES = {}


def _outcome(row_id):
    """Run the trigger of ``row_id`` once per session.

    :returns: ``(raised, warned)``: the exception as ``(type name, message)`` or
        None, and the warnings as a list of ``(category name, message)``.
    """
    if row_id not in _OUTCOMES:
        raised = None
        pyro.clear_param_store()  # as conftest does per test: a trigger may run inside another's test
        pyro.set_rng_seed(0)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            try:
                TRIGGERS[row_id]()
            except (pytest.skip.Exception, pytest.fail.Exception, KeyboardInterrupt):
                raise
            except BaseException as err:  # SystemExit too: the command line's errors
                text = err.args[0] if err.args and isinstance(err.args[0], str) else str(err)
                raised = (type(err).__name__, text)
        _OUTCOMES[row_id] = (raised, [(w.category.__name__, str(w.message)) for w in rec])
        _WARNED_AT[row_id] = [w.filename for w in rec]
    return _OUTCOMES[row_id]


_WARNED_AT = {}  # row id -> the file each of its trigger's warnings points at
TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("row_id,kind,message", ROWS, ids=[r[0] for r in ROWS])
def test_error_row(row_id, kind, message):
    """The row's trigger raises (or warns) with the row's type and message fragments."""
    raised, warned = _outcome(row_id)
    pattern = _fragments_pattern(message)
    if kind.endswith("Warning"):
        found = [m for k, m in warned if k == kind]
        assert found, f"{row_id}: no {kind}; got {warned}"
        assert any(re.search(pattern, m, re.S) for m in found), (row_id, found)
        return
    assert raised is not None, f"{row_id}: the trigger raised nothing; warnings: {warned}"
    name, text = raised
    assert name == kind, (row_id, name, text)
    assert re.search(pattern, text, re.S), (row_id, text)


@pytest.mark.parametrize("row_id,kind,message", [r for r in ROWS if r[1].endswith("Warning")],
                         ids=[r[0] for r in ROWS if r[1].endswith("Warning")])
def test_warning_points_at_the_callers_line(row_id, kind, message):
    """A row's warning names the line of the code that called pyro_mpt (the trigger, under
    tests/), not a line inside pyro_mpt, Pyro or torch, whatever the entry point's depth."""
    raised, warned = _outcome(row_id)
    pattern = _fragments_pattern(message)
    at = [f for (k, m), f in zip(warned, _WARNED_AT[row_id]) if k == kind and re.search(pattern, m, re.S)]
    if not at:
        pytest.skip(f"{row_id}: the warning comes from a subprocess")
    for filename in at:
        assert Path(filename).resolve().is_relative_to(TESTS), (row_id, filename)


# ---------------------------------------------------------------------- the code
SOURCE = Path(pyro_mpt.__file__).resolve().parent
_EXCEPTION_NAME = re.compile(r"_?[A-Z]\w*(Error|Exception|Warning|NotApplicable|Unavailable|Definite)$")

# Messages in pyro_mpt/ that no trigger produces, by "file::function": each guards an
# invariant that user input does not reach (docs/errors.md, "Internal errors").
INTERNAL = {
    "adapters/mlm_jobs.py::schedule_jobs": "a MaskBlock type not wired into the adapter",
    "conditionals/base.py::ConditionalEngine.log_evidence": "the default of engines without log p(x)",
    "conditionals/quadrature_rules.py::effective_nodes": "the engine passes tensor grids only",
    "conditionals/gaussian_jitter.py::factor_whole": "caught by the jitter rescue",
    "conditionals/decoded.py::pad_batch": "Pyro's plate checks fire first",
    "conditionals/decoded.py::Decoded._token_tensor": "models that do not broadcast fail earlier",
    "conditionals/latent_runs.py::LatentRunner._guide_values": "caught by encode, which falls back",
    "conditionals/latent_runs.py::LatentRunner.encode": "engines encode only after locate_data_arg",
    "conditionals/quadrature_nodes.py::NodeRunner._run": "models that do not broadcast fail earlier",
    "conditionals/quadrature_nodes.py::NodeRunner._check_probe_nodes": "caught by the run fallback; shown in its warning",
    "conditionals/gaussian_marginal.py::gaussian_marginal.check_probes": "caught by the run fallback; shown in its warning",
    "conditionals/latent_runs.py::LatentRunner._check_first_point": "caught by the run fallback; shown in its warning or refusal",
    "conditionals/gaussian_groups.py::LoadingColors.basis": "caught by colored_marginal, which derives the loading whole",
}


def _message_template(node):
    """The literal parts of a message expression, with None for each computed part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message_template(node.left) + _message_template(node.right)
    return [None]


class _Template:
    """The messages a message expression can produce: its literal parts in order, each run
    of computed parts a lazy gap. ``search`` first checks that every literal part occurs
    (a substring test): a regex that starts with gaps (``f"{a} {b} the ..."`` gives
    ``.*? .*? the``) backtracks quadratically on each text it does not match, which made
    this test 50 s long; the few texts that hold all the parts go to the regex."""

    def __init__(self, parts):
        self.literals = [p for p in parts if p]
        merged = []
        for p in parts:
            if not (p is None and merged and merged[-1] is None):
                merged.append(p)
        self.regex = re.compile("".join(".*?" if p is None else re.escape(p) for p in merged), re.S)

    def search(self, text):
        return all(p in text for p in self.literals) and self.regex.search(text) is not None


def _message_sites():
    """``(file::function, line, pattern)`` for every exception or warning built with a
    literal message in pyro_mpt/: ``raise E(...)``, ``E(...)`` for a class named like an
    exception, ``warnings.warn(...)`` and the command line's ``_fail(...)``. The pattern
    matches the messages it can produce (each computed part matches anything)."""
    sites = []
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        raised = {id(n.exc) for n in ast.walk(tree) if isinstance(n, ast.Raise)}

        def visit(node, qualname):
            for child in ast.iter_child_nodes(node):
                name = qualname
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{qualname}.{child.name}" if qualname else child.name
                if isinstance(child, ast.Call) and child.args:
                    fn = child.func
                    called = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", "")
                    warn = called == "warn" and isinstance(fn, ast.Attribute) and getattr(fn.value, "id", "") == "warnings"
                    fail = called == "_fail"  # the command line's error exit
                    if warn or fail or id(child) in raised or _EXCEPTION_NAME.match(called):
                        parts = _message_template(child.args[0])
                        # at least a few words of literal text: not a re-raise of str(e)
                        if sum(len(p) for p in parts if p) >= 10:
                            pattern = _Template(parts)
                            key = f"{path.relative_to(SOURCE).as_posix()}::{name}"
                            sites.append((key, child.lineno, pattern))
                visit(child, name)

        visit(tree, "")
    return sites


def test_every_message_in_the_code_has_a_row():
    """Each exception or warning message written in pyro_mpt/ is produced by some row's
    trigger (so it has a row in docs/errors.md), or is listed in INTERNAL."""
    texts, skipped = [], []
    for row_id in TRIGGERS:
        try:
            raised, warned = _outcome(row_id)
        except pytest.skip.Exception:
            skipped.append(row_id)
            continue
        texts += ([raised[1]] if raised else []) + [m for _, m in warned]
    if skipped:
        pytest.skip(f"triggers skipped (optional dependencies missing): {skipped}")
    sites = _message_sites()
    assert len(sites) > 100  # the scan sees the code
    missing = [
        f"pyro_mpt/{key.split('::')[0]}:{line} ({key.split('::')[1]})"
        for key, line, pattern in sites
        if key not in INTERNAL and not any(pattern.search(t) for t in texts)
    ]
    assert not missing, "messages with no row in docs/errors.md (or entry in INTERNAL): " + ", ".join(missing)
    assert set(INTERNAL) <= {key for key, _, _ in sites}, "INTERNAL names functions without messages"
    internal_table = ERRORS_MD.read_text(encoding="utf-8").split("## Internal errors", 1)[1]
    unlisted = [key for key in INTERNAL if key.split("::")[1].rsplit(".", 1)[-1] not in internal_table]
    assert not unlisted, f"INTERNAL entries missing from the internal errors of docs/errors.md: {unlisted}"
