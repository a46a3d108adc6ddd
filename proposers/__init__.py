"""Proposers: one module each. Importing this package registers the built-ins."""

import decoders  # noqa: F401  (the engine first, so `import proposers` alone works: its base imports it)
from proposers import (  # noqa: F401  (registration)
    draft_model,
    early_exit,  # noqa: F401  (registration)
    eagle,  # noqa: F401  (registration)
    medusa,  # noqa: F401  (registration)
    merge,
    ngram,
    suffix,
)
from proposers.base import Proposer

__all__ = ["Proposer"]
