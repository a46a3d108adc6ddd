"""Proposers: one module each. Importing this package registers the built-ins."""

from proposers.base import Proposer
from proposers import draft_model, ngram  # noqa: F401  (registration)

__all__ = ["Proposer"]
