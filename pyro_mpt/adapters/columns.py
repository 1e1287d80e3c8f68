"""The text columns of a dataset that a masked LM reads: one, or two for sentence pairs.

Checked where they are given (:class:`~pyro_mpt.adapters.masked_lm.MaskedLMScorer`,
:func:`~pyro_mpt.adapters.mlm_inputs.encode_inputs`,
:func:`~pyro_mpt.adapters.loading.load_texts` and so ``pyro-mpt mlm-curve --column``),
without torch: a usage error of the command line loads nothing.
"""

__all__ = ["text_columns"]


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
