"""Speculative decoding pipelines: the engine (sessions, sampling, decode loop,
registries, benchmark and command-line entry points)."""

import proposers  # noqa: E402,F401  (registers built-in proposers)
import verifiers  # noqa: E402,F401  (registers built-in verifiers)
from decoders.draft import Acceptance, Draft
from decoders.pipeline import GenerationResult, Pipeline  # noqa: E402
from decoders.registry import register_proposer, register_verifier
from decoders.sampling import SamplingConfig

__all__ = [
    "Acceptance",
    "Draft",
    "GenerationResult",
    "Pipeline",
    "SamplingConfig",
    "register_proposer",
    "register_verifier",
]
