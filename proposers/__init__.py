"""Proposers: one module each. Importing this package registers the built-ins."""

import decoders  # noqa: F401  (the engine first, so `import proposers` alone works: its base imports it)
from proposers.base import Proposer
from proposers import draft_model, ngram  # noqa: F401  (registration)
from proposers import early_exit  # noqa: F401  (registration)
from proposers import medusa  # noqa: F401  (registration)

__all__ = ["Proposer"]
