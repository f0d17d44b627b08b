"""A decode step's launches per layer type (benchmarks/decode_launches.py: counted on the CPU,
the Triton kernels interpreted): fewer, fuller kernels is a goal (issue 25), and a change that
adds a launch to a layer's decode path fails here. Lower the bounds when a change removes one.
With --check the same script compares the step on the Triton backends with torch_ref's in fp32
(logits and every cache part it writes), at a context whose step closes a window of every
ratio: a fused launch that writes the wrong rows fails here too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "decode_launches.py"
# Launches of a layer inside a stack at batch 1 (Triton and other), and the step's own (outside
# the layers: embedding, hc head and final norm, RoPE tables, the entry lists' derivation):
# benchmarks/RESULTS.md, 2026-12-07.
MOST = {"csa": 22, "hca": 20, "swa": 18, "step (outer)": 25}


def test_a_decode_layer_launches_no_more_than_counted(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "launches.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), "--check", "--context", "79"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row[0]: row[1:] for row in json.loads(out.read_text())["rows"]}  # Triton, other, all
    for kind, most in MOST.items():
        assert rows[kind][2] <= most, (kind, rows[kind], result.stdout)
        assert rows[kind][0] > 0 and rows[kind][2] == rows[kind][0] + rows[kind][1]
    checked = json.loads(out.read_text())["check"]
    assert set(checked) == {"csa", "hca", "swa"} and max(checked.values()) < 1e-5, checked
