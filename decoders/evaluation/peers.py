"""Hugging Face implementations measured in the same run as peers.

Each peer runs ``transformers``' own ``model.generate`` on the same prompt ids
with the same sampling settings:

    hf_generate       plain generate (its counterpart: standard decoding)
    hf_prompt_lookup  prompt lookup decoding (counterpart: ngram)
    hf_assisted       assisted generation with the same draft model (draft_model)
    hf_early_exit     assistant_early_exit self-speculation (early_exit)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from decoders.engine.sampling import SamplingConfig

PEER_COUNTERPART = {
    "hf_generate": None,
    "hf_prompt_lookup": "ngram",
    "hf_assisted": "draft_model",
    "hf_early_exit": "early_exit",
}


@dataclass
class HFPeer:
    name: str
    model: torch.nn.Module
    eos_token_ids: list[int]
    sampling: SamplingConfig
    generate_kwargs: dict[str, Any] = field(default_factory=dict)

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """Generated token ids and wall seconds."""
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([prompt_ids], device=device)
        kwargs: dict[str, Any] = dict(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_token_ids or None,
            pad_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
        )
        if self.sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            kwargs.update(
                do_sample=True,
                temperature=self.sampling.temperature,
                top_k=self.sampling.top_k or None,
                top_p=self.sampling.top_p,
            )
        kwargs.update(self.generate_kwargs)
        start = time.perf_counter()
        output = self.model.generate(**kwargs)
        elapsed = time.perf_counter() - start
        return output[0, len(prompt_ids) :].tolist(), elapsed


def make_peers(
    target: torch.nn.Module,
    eos_token_ids: list[int],
    sampling: SamplingConfig,
    proposers: dict[str, Any],
) -> list[HFPeer]:
    """hf_generate plus each peer whose counterpart proposer is being benchmarked.

    proposers: name -> Proposer instance of the pipelines in this run (their
    options set the peer's: same k, same draft model, same exit layer).
    """
    peers = [HFPeer("hf_generate", target, eos_token_ids, sampling)]
    if "ngram" in proposers:
        ngram = proposers["ngram"].config
        peers.append(
            HFPeer(
                "hf_prompt_lookup",
                target,
                eos_token_ids,
                sampling,
                {"prompt_lookup_num_tokens": ngram.k, "max_matching_ngram_size": ngram.max_n},
            )
        )
    if "draft_model" in proposers:
        draft = proposers["draft_model"]
        peers.append(
            HFPeer(
                "hf_assisted",
                target,
                eos_token_ids,
                sampling,
                {"assistant_model": draft.model, "num_assistant_tokens": draft.config.k},
            )
        )
    if "early_exit" in proposers:
        early_exit = proposers["early_exit"].config
        peers.append(
            HFPeer(
                "hf_early_exit",
                target,
                eos_token_ids,
                sampling,
                {"assistant_early_exit": early_exit.exit_layer, "num_assistant_tokens": early_exit.k},
            )
        )
    return peers
