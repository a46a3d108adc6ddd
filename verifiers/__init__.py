"""Verifiers: one module each. Importing this package registers the built-ins."""

from verifiers.base import Verifier
from verifiers import greedy, rejection  # noqa: F401  (registration)

__all__ = ["Verifier"]
