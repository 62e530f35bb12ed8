"""The fakes order work as CUDA does: small cases whose outcome CUDA's semantics decide, each with its reason.

Streams run their own work in order and nothing else's: work on stream B sees a write by stream A only after B
waited for it (``B.wait_stream(A)``, ``B.wait_event(e)`` with ``e`` recorded on A after the write) or after the
host, which issues B's work, saw A's write complete (a synchronize, a blocking copy). The caching allocator hands a
freed block to the next allocation of the stream that allocated it, at once. A 0-dim host tensor is taken beside
device tensors only where CUDA reads it as a scalar."""
import pytest
import torch
import torch.distributed as dist

from gpu_contracts.fakes import FakeGpuRank

CUDA3 = torch.device("cuda", 3)
RACE = "fake CUDA stream order"


@pytest.fixture
def rank(fake_gpu_rank):
    torch.cuda.set_device(3)
    return fake_gpu_rank


def test_a_non_blocking_copy_to_the_host_is_read_only_after_its_event_is_waited_for(rank):
    # cudaMemcpyAsync into pinned memory returns at once: the host sees the bytes once an event recorded after the
    # copy on the copy's stream has completed (Event.synchronize)
    grad, host, side = torch.full((4,), 2.0, device=CUDA3), torch.empty(4, pin_memory=True), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(grad, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    with pytest.raises(RuntimeError, match=f"{RACE}: Tensor.tolist on the host"):
        host.tolist()
    with pytest.raises(RuntimeError, match=f"{RACE}: aten::add_ on the host"):  # a host op reads it too
        host.add_(1.0)
    done.synchronize()
    assert host.tolist() == [2.0] * 4


def test_a_blocking_copy_to_the_host_waits_for_its_own_stream_only(rank):
    # .cpu() (cudaMemcpy to pageable memory) runs on the current stream and returns when that stream reached it;
    # work queued on another stream is not waited for
    side = torch.cuda.Stream()
    made = torch.zeros(4, device=CUDA3)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        made.add_(1.0)
    with pytest.raises(RuntimeError, match=f"{RACE}: aten::_to_copy on <fake default stream of cuda:3> .* aten::add_ "
                                           f"on <fake stream of cuda:3>"):
        made.cpu()
    torch.cuda.current_stream().wait_stream(side)
    assert made.cpu().tolist() == [1.0] * 4 and made.sum().item() == 4.0


def test_a_non_blocking_to_makes_pinned_memory_and_does_not_wait(rank):
    # at::native::_to_copy pins the destination of a non-blocking copy to the host and does not synchronize
    x = torch.ones(3, device=CUDA3)
    out = x.to("cpu", non_blocking=True)
    assert out.is_pinned()
    with pytest.raises(RuntimeError, match=f"{RACE}: aten::_local_scalar_dense on the host"):
        out[0].item()
    torch.cuda.current_stream().synchronize()
    assert out.tolist() == [1.0] * 3


def test_an_event_covers_the_work_of_its_stream_recorded_before_it(rank):
    side = torch.cuda.Stream()
    buffer = torch.zeros(4, device=CUDA3)
    early = torch.cuda.Event()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        early.record(side)  # before the write: waiting for it does not cover the write
        buffer.add_(3.0)
        late = torch.cuda.Event()
        late.record(side)
    torch.cuda.current_stream().wait_event(early)
    with pytest.raises(RuntimeError, match=f"{RACE}: aten::mul on <fake default stream of cuda:3>"):
        buffer * 2
    torch.cuda.current_stream().wait_event(late)
    assert (buffer * 2).tolist() == [6.0] * 4


def test_an_event_recorded_on_another_stream_does_not_guard_a_copy(rank):
    # the copy issued inside torch.cuda.stream(s) of another GPU runs on cuda:3's current stream: an event recorded
    # on s says nothing of it
    other = torch.cuda.Stream(device=0)
    grad, host = torch.ones(4, device=CUDA3), torch.empty(4, pin_memory=True)
    with torch.cuda.stream(other):
        host.copy_(grad, non_blocking=True)
        event = torch.cuda.Event()
        event.record(other)
    event.synchronize()
    with pytest.raises(RuntimeError, match=RACE):
        host.tolist()
    assert rank.misplaced_work()[0].stream is torch.cuda.default_stream(3)
    torch.cuda.synchronize()


def test_waits_are_transitive(rank):
    # B waited for A, C waits for B (after that): C's work follows A's
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(2, device=CUDA3)
    a.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(a):
        x.fill_(5.0)
    b.wait_stream(a)
    torch.cuda.current_stream().wait_stream(b)
    assert (x + 1).tolist() == [6.0, 6.0]


def test_the_host_having_synchronized_orders_later_work_on_every_stream(rank):
    # work issued after torch.cuda.synchronize() starts after everything before it ended, on whatever stream
    side = torch.cuda.Stream()
    x = torch.ones(2, device=CUDA3)
    with torch.cuda.stream(side):
        with pytest.raises(RuntimeError, match=RACE):
            x.mul_(2.0)  # x's fill on the default stream may not have run yet
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        x.mul_(2.0)
    torch.cuda.current_stream().wait_stream(side)
    assert x.tolist() == [2.0, 2.0]


def test_a_block_freed_while_another_stream_uses_it_is_reported(rank):
    # the allocator gives a freed block to its own stream's next allocation at once: another stream that still reads
    # it must be recorded on it (record_stream), or waited for before the free
    side = torch.cuda.Stream()
    host = torch.empty(4, pin_memory=True)
    for free_safely in (None, "record_stream", "wait_stream"):
        grad = torch.ones(4, device=CUDA3)  # allocated on the default stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(grad, non_blocking=True)
        if free_safely == "record_stream":
            grad.record_stream(side)
        elif free_safely == "wait_stream":
            torch.cuda.current_stream().wait_stream(side)
        del grad
        side.synchronize()
    assert len(rank.unsafe_frees) == 1 and "used on <fake stream of cuda:3>" in rank.unsafe_frees[0]
    rank.unsafe_frees.clear()  # else the fixture's exit raises, as it does for any test that frees so


def test_leaving_the_fake_rank_raises_for_an_unsafe_free():
    with pytest.raises(RuntimeError, match="freed while another stream may still use it"):
        with FakeGpuRank(local_rank=3, device_count=8):
            torch.cuda.set_device(3)
            side = torch.cuda.Stream()
            grad = torch.ones(4, device=CUDA3)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                grad.mul(2.0)
            del grad


def test_a_host_scalar_is_taken_where_cuda_reads_it_as_a_scalar_only(rank):
    x, scalar = torch.ones(2, device=CUDA3), torch.tensor(2.0)
    # TensorIterator takes a 0-dim CPU tensor as a scalar operand of an elementwise op (its output on the device)
    assert (x * scalar).device == CUDA3 and torch.where(x > 0, scalar, x).device == CUDA3
    x.fill_(scalar)  # fill_ reads the value on the host
    x[x > 1] = 0  # indexing: host indices, and a 0-dim host value moved to the device (at::native::index_put_)
    assert x.tolist() == [0.0, 0.0] and x[torch.tensor([1])].device == CUDA3
    # elsewhere every tensor must be on one device: stack and cat check their inputs' devices
    with pytest.raises(RuntimeError, match="cpu and cuda:3"):
        torch.stack([x.sum(), scalar])
    with pytest.raises(RuntimeError, match="cpu and cuda:3"):
        torch.cat([x, scalar.view(1)])
    # an in-place op's output is its first argument: a host tensor cannot take a device result
    total = torch.zeros(())
    with pytest.raises(RuntimeError, match="cpu and cuda:3"):
        total += x.sum()
    with pytest.raises(RuntimeError, match="cpu and cuda:3"):
        x.dot(torch.tensor(1.0).expand(2))  # not pointwise: a 0-dim host tensor viewed as 1-dim is no scalar


def test_a_host_scalar_is_no_collective_buffer(fake_nccl):
    torch.cuda.set_device(3)
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.tensor(1.0))


@pytest.mark.parametrize("without_gil", [False, True], ids=["deepspeed_binding", "gil_free_binding"])
def test_deepspeed_cpu_adam_reads_its_gradient_after_the_copy_is_waited_for(rank, without_gil):
    """DeepSpeed's CPU Adam kernel reads and writes host tensors in C++: its arguments are checked as host reads,
    through DeepSpeed's binding and through the host step's GIL-free one."""
    from ds_pseudo_real.offload import kernel

    param, grad = torch.zeros(4), torch.ones(4, device=CUDA3)
    adam = kernel.cpu_adam(0.1, (0.9, 0.999), 1e-8, 0.0, True, True, without_gil)
    name = "gil_free_cpu_adam" if without_gil else "cpu_adam"
    host_grad, exp_avg, exp_avg_sq = torch.empty(4, pin_memory=True), torch.zeros(4), torch.zeros(4)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host_grad.copy_(grad, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
    update = (adam.opt_id, 1, 0.1, 0.9, 0.999, 1e-8, 0.0, True, param, host_grad, exp_avg, exp_avg_sq)
    with pytest.raises(RuntimeError, match=f"{RACE}: {name}.adam_update on the host"):
        adam.ds_opt_adam.adam_update(*update)
    copied.synchronize()
    adam.ds_opt_adam.adam_update(*update)
    assert param.tolist() == pytest.approx([-0.1] * 4, rel=1e-4)


def test_random_ops_on_a_gpu_draw_from_its_own_generator(rank):
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    torch.cuda.manual_seed(7)
    first = torch.randn(3, device=CUDA3)
    assert torch.equal(torch.rand(2), expected)  # the CPU's generator did not move
    torch.cuda.manual_seed(7)
    assert torch.equal(torch.randn(3, device=CUDA3), first)
