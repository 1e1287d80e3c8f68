import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pyro  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_pyro():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Pin torch to one thread for the whole suite: its tensors are small, and on a
    shared 2-core machine a second thread only adds oversubscription stalls (an SVI
    test took 199 s with two threads under load, 7 s with one; the idle suite takes
    the same time either way).

    ``PYRO_MPT_TEST_THREADS=N`` runs the suite with N threads instead, to check that no
    test depends on the thread count (docs/numerics.md, "Checking on other kernels")."""
    old = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("PYRO_MPT_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(old)
