"""What the bench's header says of the machine: the weights' bytes and the floor they set."""

from __future__ import annotations

import torch

from specdec.decoders.models.loading import tiny_random_model
from specdec.decoders.models.machine import memory_limit, memory_limit_line, read_bandwidth, weight_bytes


def test_weight_bytes_count_a_shared_storage_once():
    model = tiny_random_model(320, 64, 2, seed=0)
    separate = weight_bytes(model)
    assert separate == sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    assert weight_bytes(model) == separate - 320 * 64 * 4
    assert weight_bytes(model.to(torch.bfloat16)) == (separate - 320 * 64 * 4) // 2


def test_the_limit_and_the_ratio_to_it():
    limit = memory_limit(270_000_000, 27.0, 0.040)
    assert limit["limit_ms"] == 10.0 and limit["ratio"] == 4.0 and limit["single_pass_ms"] == 40.0
    line = memory_limit_line(limit)
    assert line == (
        "weights 270 MB, read at 27.0 GB/s: a single-token pass takes at least 10.0 ms; "
        "standard decoding's took 40.0 ms, 4.0x that limit"
    )
    assert memory_limit_line(memory_limit(270_000_000, 27.0, None)).endswith("at least 10.0 ms")


def test_the_bandwidth_is_measured():
    assert read_bandwidth(megabytes=8, repeats=2) > 0
