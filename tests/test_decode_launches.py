"""A decode step's launches per layer type (benchmarks/decode_launches.py: counted on the CPU,
the Triton kernels interpreted): fewer, fuller kernels is a goal (issue 25), and a change that
adds a launch to a layer's decode path fails here. Lower the bounds when a change removes one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "decode_launches.py"
# Launches a layer at batch 1 (Triton, other): benchmarks/RESULTS.md, 2026-12-06.
MOST = {"csa": (25, 13), "hca": (18, 11), "swa": (15, 9)}


def test_a_decode_layer_launches_no_more_than_counted(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "launches.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row[0]: row[1:3] for row in json.loads(out.read_text())["rows"]}
    for kind, (triton, other) in MOST.items():
        assert rows[kind][0] <= triton and rows[kind][1] <= other, (kind, rows[kind], result.stdout)
    # The step's own launches are there too (embedding, hc head, RoPE tables, plans).
    assert sum(rows["step (outer)"]) > 0
