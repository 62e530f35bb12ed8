"""The test session's py-cpuinfo file (tests/site/cpuinfo_cache.py): a process a test starts reads the answer from it
instead of starting a Python process to ask the CPU, and the first to ask writes it."""
import json
import os
import subprocess
import sys

from conftest import python_path

ASK = "import cpuinfo, json; print(json.dumps(cpuinfo.get_cpu_info()))"


def ask(cache) -> dict:
    env = dict(os.environ, PYTHONPATH=python_path(), DS_PSEUDO_REAL_TEST_CPUINFO=str(cache))
    proc = subprocess.run([sys.executable, "-c", ASK], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_started_process_reads_the_session_file(tmp_path):
    cache = tmp_path / "cpuinfo.json"
    cache.write_text(json.dumps({"arch": "X86_64", "flags": ["avx2"], "written_by": "the test"}))
    assert ask(cache) == {"arch": "X86_64", "flags": ["avx2"], "written_by": "the test"}


def test_the_first_process_to_ask_writes_the_machines_answer(tmp_path):
    cache = tmp_path / "cpuinfo.json"
    answer = ask(cache)
    assert answer["arch"] and "written_by" not in answer  # py-cpuinfo's own answer
    assert json.loads(cache.read_text()) == answer
