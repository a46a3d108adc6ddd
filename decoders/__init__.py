"""Speculative decoding pipelines for Hugging Face causal LMs.

The package is split by concern: ``engine`` (contracts, decode loop, sampling,
registries, the Python API), ``models`` (loading, the KV-cache session, kernels,
the pass-cost curve), ``sizing`` (how big a draft should be) and ``evaluation``
(benchmark, audit, metrics, plots, W&B); ``bench``, ``generate``, ``audit`` and
``report`` are the command-line entry points. Importing ``decoders`` imports no
proposer or verifier: the registries import built-ins when first looked up.
"""

from specdec.decoders.engine.draft import Acceptance, Draft, Round
from specdec.decoders.engine.pipeline import GenerationResult, Pipeline
from specdec.decoders.engine.proposer import Proposer
from specdec.decoders.engine.registry import register_proposer, register_verifier
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.engine.verifier import Verifier

__all__ = [
    "Acceptance",
    "Draft",
    "Round",
    "GenerationResult",
    "Pipeline",
    "Proposer",
    "SamplingConfig",
    "Verifier",
    "register_proposer",
    "register_verifier",
]
