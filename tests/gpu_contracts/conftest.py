"""Fixtures of the CUDA/NCCL contract tests (see ``fakes.py`` for what the fakes check and how to use them).

``fake_gpu_rank``: this process as local rank 3 of a node with 8 fake GPUs (current device 0 until set).
``fake_nccl``: ``fake_gpu_rank`` and a default process group that takes tensors as NCCL does (rank 3 of 8).
Every test that ``collectives.DRIVEN_BY`` names must issue, under the fake NCCL, each collective it is named for.
"""
import os

import pytest

from gpu_contracts.collectives import calls_driven_by
from gpu_contracts.fakes import FakeGpuRank, FakeNccl


@pytest.fixture
def fake_gpu_rank():
    with FakeGpuRank(local_rank=3, device_count=8) as rank:
        yield rank


@pytest.fixture
def fake_nccl(fake_gpu_rank):
    with FakeNccl(fake_gpu_rank, group_rank=3, world_size=8) as nccl:
        yield nccl


@pytest.fixture(autouse=True)
def drives_the_collectives_it_is_named_for(request):
    FakeNccl.sites.clear()
    yield
    test = f"{os.path.basename(request.node.path)}::{request.node.name}"
    missing = [call.name for call in calls_driven_by(test) if (call.path, call.line) not in FakeNccl.sites]
    assert not missing, f"{test} is named in collectives.DRIVEN_BY for calls it never made under the fake NCCL: " \
                        f"{missing}"
