"""tools/gpu_smoke.py, run on the CPU (`--device cpu`) so that it cannot rot between GPU runs:
its runner (fresh processes per check, a timeout, one line per check, JSON out), one component
at world size 1 and the two-rank scratch check. The full CPU run is `python3
tools/gpu_smoke.py --device cpu` (two to four minutes on two cores, depending on their load)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_smoke_script_runs_its_checks_on_the_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_smoke.py"), "--device",
                           "cpu", "--only", "checkpoint.w1", "scratch.w2", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line.split()[:2] for line in proc.stdout.splitlines()
             if line.startswith(("PASS", "FAIL"))]
    assert lines == [["PASS", "checkpoint.w1"], ["PASS", "scratch.w2"]], proc.stdout
    results = json.loads(out.read_text())
    assert [(r["name"], r["ok"], r["device"]) for r in results] == [
        ("checkpoint.w1", True, "cpu"), ("scratch.w2", True, "cpu")]


def test_a_gpu_only_check_is_skipped_on_the_cpu():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_smoke
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert not gpu_smoke.runnable("cuda", "cpu") and gpu_smoke.runnable("any", "cpu")
    assert gpu_smoke.runnable("gpus2", "cpu")  # two ranks over gloo stand in for two GPUs
    assert {"ddp.w1", "zero1.w1", "zero2.w1", "fsdp.w1", "tp.w1", "hooks.w1", "checkpoint.w1",
            "train.w1", "ddp.gloo.w2", "scratch.w2", "pipeline.gpus2", "tp.gpus2",
            "train.layouts.gpus4"} <= gpu_smoke.CHECKS.keys()
