"""scripts/quantize_drift.py, behind docs/performance.md's "int8 weights", runs and counts right."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "quantize_drift.py"


def load_script():
    spec = importlib.util.spec_from_file_location("quantize_drift", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_common_prefix_ends_at_the_first_differing_token():
    module = load_script()
    assert module.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert module.common_prefix([1, 2], [1, 2, 3]) == 2
    assert module.common_prefix([5], [6]) == 0


def test_the_drift_is_measured_over_every_prompt(capsys):
    result = load_script().main(
        ["--model", "tiny-random", "--dtype", "float32", "--limit", "1", "--tokens", "6"]
    )
    assert result["prompts"] == 6  # the default workload's six categories, one prompt each
    assert 0.0 <= result["identical"] <= result["positions_agreeing"] <= 1.0
    assert 0.0 <= result["common_prefix"] <= 6
    assert set(result["ms_per_token"]) == {"none", "int8"}
    assert "int8 against float32, 6 prompts x 6 tokens" in capsys.readouterr().out
