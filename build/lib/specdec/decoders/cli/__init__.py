"""What every command-line entry point shares (``decoders.bench``, ``generate``,
``audit``, ``report`` and ``python -m specdec.train``): turning a composed Hydra config
into the project's objects (:mod:`config`) and one-line error reports
(:mod:`errors`)."""
