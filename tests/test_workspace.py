import torch

from pyro_mpt.conditionals.workspace import Workspace


def test_views_of_one_buffer_share_its_storage_and_grow_when_too_small():
    ws = Workspace(torch.float64)
    a = ws.take("a", (3, 4))
    a.fill_(1.0)
    b = ws.take("a", (2, 5))
    assert b.shape == (2, 5) and b.dtype == torch.float64
    assert b.data_ptr() == a.data_ptr()
    assert float(b.sum()) == 10.0  # the first ten of a's twelve ones
    c = ws.take("a", (4, 4))  # larger: a new buffer
    assert c.shape == (4, 4) and c.data_ptr() != a.data_ptr()
    assert ws.take("b", (2,)).data_ptr() != c.data_ptr()
