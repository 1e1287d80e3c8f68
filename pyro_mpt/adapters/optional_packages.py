"""The optional packages of pyro_mpt's ``hf`` extra (``transformers``, ``datasets``,
``accelerate``): one message for a missing one, naming the package, what needed it and how
to install it. ``loading.optional_import`` raises it as a
:class:`~pyro_mpt.adapters.loading.ResourceUnavailable`;
:func:`~pyro_mpt.adapters.batching.resolve_accelerator`, which ``loading`` imports through
the ViT-MAE load, as an ``ImportError``.
"""

__all__ = ["missing_package_message"]


def missing_package_message(package, purpose, err):
    """The message for an optional package that could not be imported.

    :param str package: the top-level package (``"datasets"``).
    :param str purpose: what needs it (``"Loading a dataset (--dataset, dataset=)"``).
    :param ImportError err: the import's error, quoted.
    :returns: str.

    Example::

        >>> missing_package_message("accelerate", "accelerator=True", ImportError("No module named 'accelerate'"))
        "accelerator=True needs the 'accelerate' package, which could not be imported (No module named ..."
    """
    return (
        f"{purpose} needs the '{package}' package, which could not be imported ({err}). Install "
        f"pyro_mpt's HuggingFace extras: pip install 'pyro-mpt[hf]' (or pip install {package})."
    )
