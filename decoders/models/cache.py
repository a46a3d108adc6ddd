"""Where the project keeps what it computes once per machine: dequantized models, cost curves,
compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the project's caches (models, cost curves, kernels); ``SPECDEC_CACHE`` overrides it."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
