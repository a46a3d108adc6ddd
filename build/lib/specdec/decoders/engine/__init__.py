"""The engine: the contracts between proposers, the target and verifiers
(:mod:`draft`, :mod:`proposer`, :mod:`verifier`, :mod:`state`), the decode loop
(:mod:`decoding`), sampling, the registries, the pipeline context and the Python
API (:mod:`pipeline`). It imports no proposer or verifier module."""
