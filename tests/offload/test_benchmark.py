"""benchmarks/offload.py on CPU: the granular arm's losses equal the no-offload arm's and its bytes equal the plan."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.parametrize("flags, levels", [
    (["--device-memory", "980KB"], {"host_optimizer", "device"}),
    # ZeRO 2 with layers at host_params, outside DeepSpeed's optimizer (exact without clipping)
    (["--device-memory", "500KB", "--max-level", "host_params", "--gradient-clipping", "0"],
     {"host_optimizer", "host_params"}),
], ids=["host_optimizer", "host_params"])
def test_cpu_benchmark_reports_exactness_and_accounting(tmp_path, flags, levels):
    out = tmp_path / "offload.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "benchmarks/offload.py", "--layers", "3", "--d-model", "32", "--steps", "2",
                           "--warmup", "1", *flags, "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    granular = next(r for r in report["results"] if r["arm"] == "granular")
    assert set(granular["plan"]["levels"].values()) == levels
    assert granular["plan"]["measured"] == {k: granular["plan"]["predicted"][k]
                                            for k in ("optimizer_device", "optimizer_host", "moved_per_step")}
    assert report["summary"]["granular_losses_equal_none"] is True
    assert report["summary"]["accounting_equal_plan"] is True
    assert "granular_losses_equal_none: True" in proc.stdout
