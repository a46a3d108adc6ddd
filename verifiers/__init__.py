"""Verifiers: one module each. Importing this package registers the built-ins."""

import decoders  # noqa: F401  (the engine first, so `import verifiers` alone works: its base imports it)
from verifiers import greedy, rejection, tree, typical  # noqa: F401  (registration)
from verifiers.base import Verifier

__all__ = ["Verifier"]
