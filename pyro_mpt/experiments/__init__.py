"""Experiments built on pyro_mpt, kept apart from the library core.

Nothing in the core (``loss``, ``masks``, ``sites``, ``conditionals``,
``evidence``, ``curve``) or in :mod:`pyro_mpt.adapters` imports this package;
it imports them.

* :mod:`~pyro_mpt.experiments.compare` -- train one model with several losses
  (MPT variants, ``Trace_ELBO``, IWAE, Rényi) and tabulate held-out
  log-likelihoods.
* :mod:`~pyro_mpt.experiments.vae` -- the deep VAE of the examples.
* :mod:`~pyro_mpt.experiments.datasets` -- small offline datasets.
* :mod:`~pyro_mpt.experiments.cli` -- the ``pyro-mpt`` command
  (``compare``), with :mod:`~pyro_mpt.experiments.curve_cli` adding
  ``mlm-curve`` and ``mae-curve``.

Submodules are imported on demand: ``import pyro_mpt.experiments`` loads none
of them.
"""
