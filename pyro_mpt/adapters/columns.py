"""The columns of a dataset that the adapters read: the text columns of a masked LM (one, or
two for sentence pairs) and the image column of a ViT-MAE.

Checked where they are given (:class:`~pyro_mpt.adapters.masked_lm.MaskedLMScorer`,
:func:`~pyro_mpt.adapters.mlm_inputs.encode_inputs`,
:func:`~pyro_mpt.adapters.loading.load_texts` and so ``pyro-mpt mlm-curve --column``;
:func:`~pyro_mpt.adapters.loading.load_images` and
:meth:`~pyro_mpt.adapters.vit_mae.MAEScorer.pixel_values`, so ``pyro-mpt mae-curve --column``),
without torch: a usage error of the command line loads nothing.
"""

__all__ = ["text_columns", "check_image_column"]

#: ``datasets`` feature types whose values are scalars: numbers, labels, booleans (strings pass,
#: as an image processor opens file paths)
_SCALAR_FEATURES = ("Value", "ClassLabel")


def text_columns(text_column, who="text_column"):
    """``text_column`` as a list of one column name, or two for sentence pairs; a
    ``ValueError`` naming ``who`` otherwise (three columns failed with a ``TypeError`` of the
    tokenizer's call, after the model had loaded).

    Example::

        >>> text_columns(("question", "sentence"))
        ['question', 'sentence']
    """
    cols = [text_column] if isinstance(text_column, str) else list(text_column)
    if not 1 <= len(cols) <= 2 or not all(isinstance(c, str) for c in cols):
        raise ValueError(
            f"{who} takes one text column, or two for sentence pairs; got {text_column!r}."
        )
    return cols


def check_image_column(ds, column, name, how):
    """Refuse an image column of ``ds`` whose values are numbers, labels or booleans, which no
    image processor reads (before: a ``TypeError`` of transformers' image loading, after the
    model had loaded; on the command line a traceback and exit status 1).

    :param ds: a ``datasets.Dataset`` holding ``column``.
    :param str name: the dataset, for the message (``"'cifar10'"``, ``"the dataset"``).
    :param str how: the argument that chooses the column (``"--column"``).
    :raises ValueError: naming the column, what it holds and the dataset's image columns.

    Example::

        >>> check_image_column(Dataset.from_dict({"label": [0]}), "label", "the dataset", "--column")
        Traceback (most recent call last):
        ValueError: Column 'label' of the dataset holds int64 values (int 0 at row 0), not images; ...
    """
    feature = ds.features[column]
    kind = type(feature).__name__
    if kind not in _SCALAR_FEATURES or getattr(feature, "dtype", None) in ("string", "large_string"):
        return
    what = f"{feature.dtype} values" if kind == "Value" else "class labels"
    if len(ds):
        v = ds[0][column]
        what += f" ({type(v).__name__} {v!r} at row 0)"
    images = [c for c, f in ds.features.items() if type(f).__name__ == "Image"]
    which = f"one of its image columns {images}" if images else "a column of images (it has no Image column)"
    raise ValueError(f"Column {column!r} of {name} holds {what}, not images; pass {how} with {which}.")
