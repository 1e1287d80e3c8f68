"""Small image datasets as token matrices for the examples and the comparison CLI.

``load_dataset("digits")`` uses scikit-learn's bundled 8x8 ``load_digits``
(1797 images, D = 64, no download); ``load_dataset("mnist")`` uses torchvision's
MNIST (28x28, D = 784; needs ``pip install pyro-mpt[vision]`` and the files
under ``root`` or a network connection). Pixels are scaled to [0, 1] and, with
``binarize=True``, thresholded at 0.5 for Bernoulli likelihoods.
"""

import torch

__all__ = ["load_dataset", "DATASETS"]

#: dataset names understood by :func:`load_dataset`
DATASETS = ("digits", "mnist")


def _split(x, n_train, n_test, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(x.shape[0], generator=g, device="cpu")
    x = x[perm]
    if n_test is None:
        n_test = max(1, x.shape[0] // 6)
    if n_test >= x.shape[0]:
        raise ValueError(
            f"n_test={n_test} leaves no training data out of {x.shape[0]} images; pass "
            f"n_test < {x.shape[0]}."
        )
    test, train = x[:n_test], x[n_test:]
    if n_train is not None:
        train = train[:n_train]
    return train, test


def load_dataset(name="digits", *, binarize=True, n_train=None, n_test=None, seed=0, root="~/.cache/pyro_mpt", dtype=None):
    """Load a dataset as ``(train, test)`` tensors of shape ``(N, D)`` with values in [0, 1].

    :param str name: ``"digits"`` (scikit-learn, 8x8) or ``"mnist"`` (torchvision, 28x28).
    :param bool binarize: threshold the scaled pixels at 0.5 (for Bernoulli tokens).
    :param int n_train: keep at most this many training images (after shuffling).
    :param int n_test: held-out images (default: a sixth of the data for digits,
        the official test split capped at 10000 for MNIST).
    :param int seed: seed of the shuffle.
    :param str root: download/cache folder for MNIST.
    :param torch.dtype dtype: default ``torch.get_default_dtype()``.

    Example::

        >>> train, test = load_dataset("digits", binarize=True)
        >>> train.shape, test.shape
        (torch.Size([1498, 64]), torch.Size([299, 64]))
    """
    dtype = dtype or torch.get_default_dtype()
    if name == "digits":
        try:
            from sklearn.datasets import load_digits
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "load_dataset('digits') needs scikit-learn: pip install pyro-mpt[examples]"
            ) from e
        x = torch.as_tensor(load_digits().data, dtype=dtype) / 16.0
        train, test = _split(x, n_train, n_test, seed)
    elif name == "mnist":
        try:
            import torchvision
        except ImportError as e:
            raise ImportError(
                "load_dataset('mnist') needs torchvision: pip install pyro-mpt[vision] "
                "(or use the bundled 'digits' dataset)."
            ) from e
        import os

        root = os.path.expanduser(root)
        sets = []
        for train_split in (True, False):
            ds = torchvision.datasets.MNIST(root, train=train_split, download=True)
            sets.append(ds.data.reshape(ds.data.shape[0], -1).to(dtype) / 255.0)
        g = torch.Generator().manual_seed(seed)
        train = sets[0][torch.randperm(sets[0].shape[0], generator=g, device="cpu")]
        test = sets[1][torch.randperm(sets[1].shape[0], generator=g, device="cpu")]
        if n_train is not None:
            train = train[:n_train]
        test = test[: (n_test if n_test is not None else 10000)]
    else:
        raise ValueError(f"Unknown dataset {name!r}; use one of {', '.join(map(repr, DATASETS))}.")
    if binarize:
        train, test = (train > 0.5).to(dtype), (test > 0.5).to(dtype)
    return train, test
