"""benchmarks/ep_collectives.py (the multi-GPU issue's links and dispatch/combine run) on the CPU:
two gloo rank processes, tiny sizes. Each dispatch/combine is checked in the run (pass-through
experts: a token's row times its weights' sum), so a wrong exchange fails the script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "ep_collectives.py"


def test_two_gloo_ranks_measure_the_links_and_a_checked_exchange(tmp_path: Path) -> None:
    import json

    out = tmp_path / "figures.json"
    args = ["--ranks", "2", "--sizes-mb", "0.25", "--decode", "1,8", "--prefill", "32"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--repeats", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for title in ("all-to-all (2 ranks, cpu)", "point to point", "dispatch + combine"):
        assert title in result.stdout, result.stdout
    figures = json.loads(out.read_text())
    assert [r["tokens"] for r in figures["moe"]] == [1, 8, 32]
    assert all(r["s"] > 0 and r["bytes"] > 0 for r in figures["moe"])
    assert figures["all_to_all"][0]["busbw"] > 0 and figures["p2p"][0]["bw"] > 0
