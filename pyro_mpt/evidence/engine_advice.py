r"""Engine refusals read from ``Evidence``: which ``method`` serves each engine.

The methods of :class:`~pyro_mpt.evidence.Evidence` run the conditional engines, and
an engine that declines a model says what to use instead in the loss's terms
(``conditionals='enumerate'``). From ``Evidence`` those words point at an argument
the user does not have; :func:`in_evidence_terms` adds the translation.
"""

import re

__all__ = ["ENGINE_METHODS", "in_evidence_terms"]

#: the ``Evidence`` method that runs each conditional engine
ENGINE_METHODS = {
    "gaussian": "exact", "enumerate": "exact", "hmm": "exact", "hierarchical": "exact",
    "quadrature": "quadrature", "importance": "importance",
}


def in_evidence_terms(message):
    """``message``, an engine's refusal, with the ``Evidence`` method of every engine it
    names as ``conditionals='...'`` (and the names listed after one: ``or 'importance'``)
    appended.

    :param str message: the engine's message.
    :returns: str.

    Example::

        >>> in_evidence_terms("Use conditionals='enumerate' or 'importance'.")
        "Use conditionals='enumerate' or 'importance'. (From Evidence, conditionals 'enumerate' is method='exact'; 'importance' is method='importance'.)"
    """
    named = []
    for run in _NAMED.finditer(message):
        for name in _NAME.findall(run.group(0)):
            if name in ENGINE_METHODS and name not in named:
                named.append(name)
    if not named:
        return message
    by_method = {}
    for name in named:
        by_method.setdefault(ENGINE_METHODS[name], []).append(f"'{name}'")
    pairs = "; ".join(f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} method='{method}'"
                      for method, names in by_method.items())
    return f"{message} (From Evidence, conditionals {pairs}.)"


#: ``conditionals='a'`` and the names listed after it (``, 'b' or 'c'``)
_NAMED = re.compile(r"conditionals='\w+'(?:\s*(?:,|or|and)\s*'\w+')*")
_NAME = re.compile(r"'(\w+)'")
