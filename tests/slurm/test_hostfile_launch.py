"""The generated DeepSpeed hostfile drives the real ``deepspeed`` launcher: two "nodes" (one rank each) on this
machine, started the way a site without passwordless ssh starts them, ``--no_ssh --node_rank N`` on each node."""
import os
import subprocess
import sys
from pathlib import Path

from conftest import free_port, python_path

REPO = Path(__file__).resolve().parents[2]


def test_two_node_deepspeed_launch_from_generated_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    subprocess.run([sys.executable, "-m", "launch.hostfile", "--nodes", "node[1-2]", "--slots", "1", "-o",
                    str(hostfile)], cwd=REPO, check=True, capture_output=True)
    assert hostfile.read_text() == "node1 slots=1\nnode2 slots=1\n"

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": python_path()})
    deepspeed = Path(sys.executable).with_name("deepspeed")
    port, run = free_port(), tmp_path / "run"
    launchers = [
        subprocess.Popen([str(deepspeed), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
                          "--master_addr", "127.0.0.1", "--master_port", str(port), str(REPO / "launch" / "train.py"),
                          "--deepspeed_config", str(REPO / "configs" / "tiny_cpu.json"), "--output-dir", str(run),
                          "--steps", "3", "--eval-batches", "1"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)
    ]
    outputs = []
    try:
        for launcher in launchers:
            outputs.append(launcher.communicate(timeout=600)[0])
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    for node, (launcher, out) in enumerate(zip(launchers, outputs)):
        assert launcher.returncode == 0, out[-4000:]
        # The hostfile gives node N the global ranks after node N-1's slots: here rank N.
        assert f"rank {node}/2 started" in out, out[-4000:]
        assert f"rank {node} finished at step 3 stage pseudo" in out, out[-4000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step3"
