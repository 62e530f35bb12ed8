"""Every collective the project's code calls is driven under the fake NCCL by a test (NCCL refuses a host tensor
that gloo takes: a collective only ever run on gloo can crash a first GPU run), or says why it never sees a device
tensor (``collectives.py``)."""
from pathlib import Path

from gpu_contracts.collectives import DRIVEN_BY, GLOO_ONLY, find_calls

HERE = Path(__file__).parent


def test_every_collective_call_is_driven_under_the_fake_nccl_or_gloo_only():
    calls = find_calls()
    assert len(calls) >= 13  # the syntax tree search finds the calls known today
    undriven = [f"{c.name} (line {c.line})" for c in calls if c.name not in DRIVEN_BY and not c.gloo_only]
    assert not undriven, (f"collective calls no test drives under the fake NCCL: {undriven}; name the test in "
                          f"collectives.DRIVEN_BY, or, where the call never sees a device tensor, say why in a "
                          f"'# {GLOO_ONLY} ...' comment on its line")
    assert set(DRIVEN_BY) <= {c.name for c in calls}, "DRIVEN_BY names calls that are gone"


def test_every_test_named_exists():
    for test in set(DRIVEN_BY.values()):
        file, name = test.split("::")
        assert f"def {name.split('[')[0]}(" in (HERE / file).read_text(), test


def test_the_search_finds_collectives_however_they_are_imported(tmp_path, monkeypatch):
    from gpu_contracts import collectives

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import torch.distributed as dist\nfrom deepspeed import comm\nfrom torch.distributed import barrier\n"
        "import torch\n\n"
        "def f(t):\n    dist.all_reduce(t)\n    dist.all_reduce(t)\n    comm.broadcast(t, 0)\n    barrier()\n"
        "    torch.distributed.all_gather_object([], 1)\n    t.gather(0, t)  # a tensor's own method: no collective\n"
        "    dist.get_rank()\n\n"
        "class C:\n    def g(self, t):\n        dist.all_reduce(t)  # gloo-only: a host tensor on the gloo group\n")
    monkeypatch.setattr(collectives, "REPO", tmp_path)
    monkeypatch.setattr(collectives, "ROOTS", ("pkg",))
    assert [(c.name, c.line, c.gloo_only) for c in collectives.find_calls()] == [
        ("pkg/m.py:f:all_reduce", 7, False), ("pkg/m.py:f:all_reduce#2", 8, False),
        ("pkg/m.py:f:broadcast", 9, False), ("pkg/m.py:f:barrier", 10, False),
        ("pkg/m.py:f:all_gather_object", 11, False), ("pkg/m.py:C.g:all_reduce", 17, True)]
