"""scripts/pass_routes.py, the timing behind docs/performance.md's "Where a pass goes", runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pass_routes.py"


def test_the_route_timing_prints_every_route(monkeypatch):
    spec = importlib.util.spec_from_file_location("pass_routes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "read_bandwidth", lambda: 20.0)
    report = module.main(
        [
            "--model",
            "tiny-random",
            "--dtype",
            "bfloat16",
            "--prefix",
            "20",
            "--widths",
            "1,3",
            "--repeats",
            "2",
        ]
    )
    lines = report.splitlines()
    assert lines[0] == "| pass over n tokens, ms | 1 | 3 |"
    assert [line.split(" | ")[0].removeprefix("| ") for line in lines[2:6]] == [
        name for name, _, _ in module.ROUTES
    ]
    assert all(float(cell) > 0 for line in lines[2:6] for cell in line.strip("| ").split(" | ")[1:])
    assert "read at 20.0 GB/s" in lines[6] and "x that limit" in lines[6]
