"""``import pyro_mpt`` and the command's argument parsing load neither torch nor Pyro
(the public names come from their modules on first use); the names are the modules' own."""

import importlib
import os
import subprocess
import sys

import pytest

import pyro_mpt

from models import ROOT


def _fresh_python(code):
    """Run ``code`` in a new interpreter importing this checkout; returns its stdout."""
    # the caller's PYTHONPATH kept after the checkout: packages may be installed there (on the
    # GPU machine Pyro was, and this test failed with PYTHONPATH set to the checkout alone)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_and_usage_errors_load_no_torch():
    """A parse-time error, the curve commands' checks of --sigma2 and of an output path
    that is a folder, and compare's --json in a file (made before the checks that need torch)."""
    code = (
        "import sys, pyro_mpt\n"
        "from pyro_mpt.experiments.cli import main\n"
        "for argv in (['mlm-curve', 'no-such-org/m', '--text-file', 'x.txt', '--num-masks', '0'],\n"
        "             ['mae-curve', 'no-such-org/m', '--image-folder', '.', '--sigma2', '-1'],\n"
        "             ['mlm-curve', 'no-such-org/m', '--text-file', 'x.txt', '--json', '.'],\n"
        "             ['compare', '--json', 'README.md/c.json']):\n"
        "    print('exit', main(argv))\n"
        "print(sorted(m for m in ('torch', 'pyro', 'transformers') if m in sys.modules))\n"
        "pyro_mpt.Evidence\n"
        "print('torch' in sys.modules)\n"
    )
    assert _fresh_python(code).split("\n")[:6] == ["exit 2"] * 4 + ["[]", "True"]


@pytest.mark.parametrize("name", pyro_mpt.__all__)
def test_every_public_name_is_its_module_s_object(name):
    value = getattr(pyro_mpt, name)
    assert getattr(importlib.import_module(value.__module__), name) is value
    assert name in dir(pyro_mpt)


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="module 'pyro_mpt' has no attribute 'MaskedPretrainingLos'"):
        pyro_mpt.MaskedPretrainingLos
    namespace = {}
    exec("from pyro_mpt import *", namespace)  # every name of __all__ resolves
    assert set(pyro_mpt.__all__) <= set(namespace)


def test_submodules_are_attributes_after_import_alone():
    """``import pyro_mpt`` then ``pyro_mpt.masks.AllSizes``: the eager package made its
    modules attributes, and scripts use them so (an AttributeError with the lazy package
    until this was added)."""
    code = (
        "import pyro_mpt, pyro_mpt.adapters as ad\n"
        "print(pyro_mpt.masks.AllSizes.__name__, pyro_mpt.conditionals.GaussianConditionals.__name__,\n"
        "      ad.rates.table2_area.__name__, pyro_mpt.experiments.__name__)\n"
        "try:\n"
        "    pyro_mpt.no_such_module\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    assert _fresh_python(code).split("\n")[:2] == [
        "AllSizes GaussianConditionals table2_area pyro_mpt.experiments",
        "module 'pyro_mpt' has no attribute 'no_such_module'",
    ]
