"""The fakes behave as CUDA and NCCL do where the project's contracts depend on it: devices of tensors, errors on
mixed devices, streams (work runs on its device's current stream), events, pinned memory, collectives."""
import os

import pytest
import torch
import torch.distributed as dist

from gpu_contracts.fakes import FakeGpuRank, FakeNccl, fake_device

CUDA3 = torch.device("cuda", 3)


def test_tensors_report_their_device_and_mixing_devices_raises(fake_gpu_rank):
    assert os.environ["LOCAL_RANK"] == "3" and torch.cuda.is_available() and torch.cuda.device_count() == 8
    assert torch.zeros(2, device="cuda").device == torch.device("cuda", 0)  # a fresh process: device 0
    torch.cuda.set_device(fake_gpu_rank.device)
    w = torch.nn.Parameter(torch.arange(4.0).view(2, 2).to("cuda"))
    x = torch.ones(1, 2, device="cuda:3")
    y = torch.nn.functional.linear(x, w)
    assert (w.device, w.data.device, y.device, y.is_cuda, y.get_device()) == (CUDA3, CUDA3, CUDA3, True, 3)
    assert y.tolist() == [[1.0, 5.0]]  # real values
    y.sum().backward()
    assert w.grad.device == CUDA3 and w.grad.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    with pytest.raises(RuntimeError, match="gradient located on device cpu to a tensor on cuda:3"):
        w.grad = torch.zeros(2, 2)
    w.grad = None
    assert w.detach().to(CUDA3, copy=True).data_ptr() != w.data_ptr() and w.to(CUDA3) is w
    host = w.detach().cpu()
    assert host.device.type == "cpu" and host.data_ptr() != w.data_ptr()
    assert (w * torch.tensor(2.0)).device == CUDA3  # a 0-dim host tensor is a scalar, as on CUDA
    with pytest.raises(RuntimeError, match="same device, but found at least two devices, cpu and cuda:3"):
        torch.ones(2, 2) + w
    with pytest.raises(RuntimeError, match="cuda:0 and cuda:3"):
        torch.ones(2, 2, device="cuda:0") + w
    assert torch.nn.Linear(2, 2).cuda().weight.device == CUDA3
    assert torch.tensor([1.0], device="cuda").device == CUDA3 and torch.as_tensor(2.0, device=3).device == CUDA3
    assert torch.empty(4, pin_memory=True).is_pinned() and not torch.empty(4).is_pinned()
    assert torch.zeros(4).pin_memory().is_pinned()
    made = len(fake_gpu_rank.allocations)
    buffer = torch.empty(256, device="cuda:3")
    assert fake_gpu_rank.allocations[made:][0].nbytes == 1024 and fake_gpu_rank.live_bytes(3) >= 1024
    before = fake_gpu_rank.live_bytes(3)
    buffer.untyped_storage().resize_(0)
    assert fake_gpu_rank.live_bytes(3) == before - 1024
    assert fake_gpu_rank.touched == {torch.device("cuda", 0), CUDA3}
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.zeros(1, device="cuda:8")


def test_work_runs_on_the_current_stream_of_its_device(fake_gpu_rank):
    """torch.cuda.stream(s) makes s current on s's device only: a copy of a cuda:3 tensor inside a stream of cuda:0
    runs on cuda:3's current stream, which an event recorded on s does not cover: the host that waited for that
    event and reads the copy reads it too early."""
    torch.cuda.set_device(3)
    grad = torch.ones(4, device="cuda:3")
    wrong, right = torch.cuda.Stream(device=0), torch.cuda.Stream()
    assert (wrong.device, right.device) == (torch.device("cuda", 0), CUDA3)
    hosts = {}
    for stream in (wrong, right):
        hosts[stream] = host = torch.empty(4, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream())  # grad was made on cuda:3's default stream
        with torch.cuda.stream(stream):
            host.copy_(grad, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        assert torch.cuda.current_device() == 3 and torch.cuda.current_stream().default
        event.synchronize()
        if stream is wrong:
            with pytest.raises(RuntimeError, match="stream order: Tensor.tolist on the host uses .* aten::copy_ on "
                                                   "<fake default stream of cuda:3>"):
                host.tolist()
    assert hosts[right].tolist() == [1.0] * 4
    misplaced, = fake_gpu_rank.misplaced_work()
    assert (misplaced.op, misplaced.context, misplaced.stream) == ("aten::copy_", wrong, torch.cuda.default_stream(3))
    assert [w.stream for w in fake_gpu_rank.works if w.to_host] == [torch.cuda.default_stream(3), right]
    with torch.cuda.stream(right):
        hosts[right].copy_(grad, non_blocking=True)
    assert len(fake_gpu_rank.unwaited_copies()) == 1  # nothing waited for the last copy
    with pytest.raises(RuntimeError, match="record_stream: a tensor on cuda:3 recorded on a stream of cuda:0"):
        grad.record_stream(wrong)
    torch.cuda.synchronize()  # the copies in flight: done before the buffers are freed


def test_collectives_take_tensors_on_the_ranks_gpu_only(fake_nccl):
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (3, 8, "nccl")
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(2))
    with pytest.raises(RuntimeError, match="on cuda:0; this rank's communicator is on cuda:3"):
        dist.all_reduce(torch.ones(2, device="cuda:0"))
    out = [None] * 8
    with pytest.raises(RuntimeError, match="a tensor on cuda:0"):  # object collectives use the current device
        dist.all_gather_object(out, {"step": 1})
    with pytest.raises(RuntimeError, match="NCCL barrier on cuda:0"):
        dist.barrier()
    torch.cuda.set_device(3)
    dist.all_gather_object(out, {"step": 1})
    dist.barrier()
    t = torch.ones(2, device="cuda:3")
    dist.all_reduce(t)
    assert out == [{"step": 1}] * 8 and t.tolist() == [1.0, 1.0]
    assert ("c10d::allreduce_", [CUDA3]) in fake_nccl.calls


def test_everything_is_undone_and_another_process_group_is_kept():
    if not dist.is_initialized():  # as after an earlier test's deepspeed.initialize
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    before = dist.group.WORLD
    cpu_to, device = torch.Tensor.to, torch.Tensor.device

    with FakeGpuRank(local_rank=1, device_count=2) as rank, FakeNccl(rank, group_rank=1, world_size=2):
        t = torch.zeros(1, device="cuda:1")
        assert dist.get_world_size() == 2 and fake_device(t) == torch.device("cuda", 1)
    assert dist.group.WORLD is before and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    one = torch.ones(1)
    dist.all_reduce(one)  # the group set aside still works
    assert torch.Tensor.to is cpu_to and torch.Tensor.device is device and not torch.cuda.is_available()
    assert t.device.type == "cpu"
