"""A model family of the main job is one module that registers itself (``ds_pseudo_real.models.registry``): a
package that declares ``tests/model_family/tiny_family.py`` in its metadata gets the main job to check and train
that model, without a line anywhere else; the built-in families are registered the same way."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, free_port, python_path
from ds_pseudo_real.models import registry

FAMILY_DIR = Path(__file__).parent / "model_family"


def installed_family(tmp_path: Path) -> str:
    """A folder holding what installing a package that declares the tiny family leaves in site-packages: its
    metadata (a dist-info with the entry point); the module itself stays where it is. Returns the PYTHONPATH."""
    info = tmp_path / "tiny_family_package-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-family-package\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINTS}]\ntiny = tiny_family\n")
    return python_path(tmp_path, FAMILY_DIR)


def run(tmp_path, *args, expect=0):
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=installed_family(tmp_path))
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_the_built_in_families_are_registered():
    assert list(registry.families()) == ["gpt", "hf", "m6"]
    with pytest.raises(ValueError, match="a model family 'gpt' is registered already"):
        registry.register(registry.ModelFamily(type("Other", (registry.families()["gpt"].section,), {}),
                                               spec=None, build=None, parameter_total=None, docs_row=""))


def test_a_family_declared_by_a_package_is_checked_and_trained_by_the_main_job(tmp_path):
    config = tmp_path / "tiny.json"
    cfg = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    cfg["pseudo_to_real"]["switch"] = {"at_step": 2}
    cfg["tiny"] = {"n_layer": 4, "width": 16, "seq_len": 16}
    config.write_text(json.dumps(cfg))
    checked = run(tmp_path, "--check", str(config))
    assert "ok: " in checked and "tiny model, 4 layers, sequence 16" in checked
    cfg["tiny"]["width"] = 18
    config.write_text(json.dumps(cfg))
    assert "tiny.width: got 18; a multiple of 4 is accepted" in run(tmp_path, "--check", str(config), expect=2)
    cfg["tiny"]["width"] = 16
    config.write_text(json.dumps(cfg))
    trained = run(tmp_path, "--deepspeed_config", str(config), "--output-dir", str(tmp_path / "run"), "--steps", "3",
                  "--eval-interval", "3", "--eval-batches", "1", "--corpus-bytes", str(1 << 18))
    assert "delinked at step 2" in trained
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in records if "train_loss" in r] == ["pseudo", "pseudo", "real"]
    # the real model: 4 layers of their own, the embedding (256 x 16), the head (16 x 256 + 256)
    assert re.search(r"parameters? .*?" + f"{256 * 16 + 4 * (2 * 16 + 16 * 16 + 16) + 16 * 256 + 256:,}", trained)
