"""The host step's GIL-free CPU Adam op (``ds_pseudo_real.offload.kernel``): DeepSpeed's kernel compiled with this
package's binding. Its steps equal those of DeepSpeed's own binding bit for bit, and a call lets other Python threads
run while the kernel works (seen deterministically: a thread reads a parameter whose first elements are stepped and
whose last are not yet; DeepSpeed's binding, which holds the GIL for the whole call, never lets that be seen)."""
import threading

import pytest
import torch

from ds_pseudo_real.offload import kernel

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adamw_mode=True, bias_correction=True)


def adam_step(adam, step, param, grad, exp_avg, exp_avg_sq):
    adam.ds_opt_adam.adam_update(adam.opt_id, step, HYPER["lr"], *HYPER["betas"], HYPER["eps"],
                                 HYPER["weight_decay"], HYPER["bias_correction"], param, grad, exp_avg, exp_avg_sq)


def state(numel, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen), torch.randn(numel, generator=gen), torch.zeros(numel),
            torch.zeros(numel)]


def test_the_gil_free_op_steps_bit_for_bit_as_deepspeeds_binding():
    ours = kernel.cpu_adam(**HYPER, without_gil=True)
    theirs = kernel.cpu_adam(**HYPER, without_gil=False)
    assert isinstance(ours, kernel.GilFreeCPUAdam) and not isinstance(theirs, kernel.GilFreeCPUAdam)
    a, b = state(100_003, 0), state(100_003, 0)  # not a multiple of the kernel's vector width
    for step in range(1, 6):
        grad = torch.randn(100_003, generator=torch.Generator().manual_seed(step))
        a[1].copy_(grad), b[1].copy_(grad)
        adam_step(ours, step, *a)
        adam_step(theirs, step, *b)
    start = state(100_003, 0)[0]
    assert not torch.equal(a[0], start)  # it stepped
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def seen_mid_step(adam, numel=1 << 24, tries=3) -> bool:
    """Whether this thread, while another steps ``numel`` elements, sees the first element stepped and the last not."""
    param, grad, exp_avg, exp_avg_sq = state(numel, 1)
    for step in range(1, tries + 1):
        first, last = param[0].item(), param[-1].item()
        worker = threading.Thread(target=adam_step, args=(adam, step, param, grad, exp_avg, exp_avg_sq))
        worker.start()
        seen = False
        while worker.is_alive() and not seen:
            seen = param[0].item() != first and param[-1].item() == last
        worker.join()
        assert param[0].item() != first and param[-1].item() != last  # the whole step was done
        if seen:
            return True
    return False


def test_other_threads_run_python_while_the_gil_free_op_steps():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one kernel thread: it walks the tensor from its first element to its last
    try:
        assert seen_mid_step(kernel.cpu_adam(**HYPER, without_gil=True))
        assert not seen_mid_step(kernel.cpu_adam(**HYPER, without_gil=False), tries=1)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("without_gil", [True, False])
def test_each_kernel_instance_has_its_own_id(without_gil):
    first, second = (kernel.cpu_adam(**HYPER, without_gil=without_gil) for _ in range(2))
    assert first.opt_id != second.opt_id
