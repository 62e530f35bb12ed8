"""Re-introduce, one at a time, each defect the CUDA/NCCL contract tests are there to catch, and check that the
tests fail on it: the defects of the first GPU review (a device chosen before DeepSpeed sets it, host tensors into
NCCL, fetched layers kept alive, host state moved to the device on a resume, the delink's gathered state or its
noisy copies on the device or all at once) and the stream and device mistakes of the second (a missing wait, a
missing record_stream, an event on the wrong stream, a copy to the host read before its event, a host scalar where
CUDA takes none, the pipeline's refusal all-reducing a host tensor).

Not among them: the side stream's wait for the compute stream before a host_params layer is fetched
(``HostParamStore._copy_to_device``). The fetch reads host memory the host wrote before issuing it, into a block the
allocator gives the side stream (the block a release freed is held for the compute stream that used it, through
``record_stream``): CUDA needs no wait there, and the fakes, which model exactly that, agree. The wait stays, as
ordering that costs nothing.

Run by hand (minutes; not part of the suite): ``python tests/gpu_contracts/mutations.py [NAME ...]``. Each mutation
is a text replacement in one file, undone afterwards whatever happens; it prints one line per mutation, ``caught``
with the first failing test, or ``MISSED``, and exits 1 if any was missed."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = ["tests/gpu_contracts"]

# name: (file, the text as it is, the defect, the tests that must catch it)
MUTATIONS = {
    "device not set before the engine": (
        "ds_pseudo_real/controller.py", "        use_rank_device()  # before",
        "        pass  # before", CONTRACTS),
    "main job's device not set before init_distributed": (
        "launch/train.py", "    use_rank_device()  # NCCL's communicator", "    pass  # NCCL's communicator",
        CONTRACTS),
    "loss sums stacked on the host": (
        "launch/trainer.py", "total = torch.stack([v.detach().float().reshape(()).to(device) for v in values])",
        "total = torch.stack([v.detach().float().reshape(()) for v in values])", CONTRACTS),
    "evaluation sum on the host": (
        "launch/trainer.py", "total = torch.zeros((), device=engine.device)", "total = torch.zeros(())", CONTRACTS),
    "training loss sum on the host": (
        "launch/trainer.py", "loss_sum = torch.zeros((), device=engine.device)", "loss_sum = torch.zeros(())",
        CONTRACTS),
    "Megatron delink's shards summed on the host": (
        "megatron_patches/delink.py",
        'full = {k: torch.zeros(param.numel(), dtype=torch.float32, device=device) for k in ("main", *MOMENTS)}',
        'full = {k: torch.zeros(param.numel(), dtype=torch.float32) for k in ("main", *MOMENTS)}', CONTRACTS),
    "Megatron delink's step on the host": (
        "megatron_patches/delink.py", "step = torch.zeros((), dtype=torch.float32, device=device)",
        "step = torch.zeros((), dtype=torch.float32)", CONTRACTS),
    "ZeRO 0's missing gradient on the host": (
        "ds_pseudo_real/offload/params.py", "zeros = torch.zeros(p.shape, dtype=p.dtype, device=self.device)",
        "zeros = torch.zeros(p.shape, dtype=p.dtype, device=p.device)", CONTRACTS),
    "pipeline refusal all-reduces a host tensor": (
        "ds_pseudo_real/offload/__init__.py", "anywhere = torch.tensor([len(refused)], device=rank_device())",
        "anywhere = torch.tensor([len(refused)])", CONTRACTS),
    "fetched copies not freed in place": (
        "ds_pseudo_real/offload/params.py", "                t.untyped_storage().resize_(0)  # with the views",
        "                pass  # with the views", CONTRACTS),
    "host-level state loaded onto the device": (
        "ds_pseudo_real/offload/optimizer_state.py",
        "    host_states = _take_host_states(optimizer.param_groups, state_dict)\n",
        "    host_states = {}\n", CONTRACTS),
    "delink gathers onto the device": (
        "ds_pseudo_real/stages.py", "                                                      GATHERED_ON)",
        "                                                      rank_device())", CONTRACTS),
    "delink's noisy copies made all at once": (
        "ds_pseudo_real/stages.py", "        if isinstance(weights, Starts) and weights.made_on_read(name):",
        "        if False:", CONTRACTS),
    "gradient copy to the host without waiting for the backward": (
        "ds_pseudo_real/offload/host_adam.py",
        "            self.to_host_stream.wait_stream(torch.cuda.current_stream(self.device))\n",
        "            pass\n", CONTRACTS),
    "CPU Adam reads gradients before their copy's event": (
        "ds_pseudo_real/offload/host_adam.py", "                batch.copied.synchronize()",
        "                pass", CONTRACTS),
    "gradient copies' event recorded on the compute stream": (
        "ds_pseudo_real/offload/host_adam.py", "                batch.copied.record(self.to_host_stream)",
        "                batch.copied.record(torch.cuda.default_stream(self.device))", CONTRACTS),
    "masters copied back without the compute stream waiting": (
        "ds_pseudo_real/offload/host_adam.py",
        "            torch.cuda.current_stream(self.device).wait_stream(self.to_device_stream)",
        "            pass", CONTRACTS),
    "fetched layer used before its copy's event": (
        "ds_pseudo_real/offload/params.py", "                compute.wait_event(event)",
        "                pass", CONTRACTS),
    "fetched layer not recorded on the compute stream": (
        "ds_pseudo_real/offload/params.py", "                    t.record_stream(compute)  # allocated",
        "                    pass  # allocated", CONTRACTS),
    "streamed gradient not recorded on the copy stream": (
        "ds_pseudo_real/offload/gradients.py", "                    grad.record_stream(stream)  # freed below",
        "                    pass  # freed below", CONTRACTS),
    "streamed gradients read before their event": (
        "ds_pseudo_real/offload/gradients.py", "                flush.event.synchronize()",
        "                pass", CONTRACTS),
    "streamed gradients copied without waiting for the backward": (
        "ds_pseudo_real/offload/gradients.py",
        "            stream.wait_stream(torch.cuda.current_stream(grads[0].device))", "            pass", CONTRACTS),
}


def run(name: str) -> bool:
    path, old, new, tests = MUTATIONS[name]
    file = REPO / path
    text = file.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{name}: the text to replace occurs {text.count(old)} times in {path}; update MUTATIONS")
    file.write_text(text.replace(old, new))
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                              cwd=REPO, capture_output=True, text=True)
    finally:
        file.write_text(text)
    failed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    print(f"{'caught' if proc.returncode else 'MISSED'}: {name} ({path})"
          + (f" by {failed[0]}" if failed else ""), flush=True)
    return proc.returncode != 0


if __name__ == "__main__":
    names = sys.argv[1:] or list(MUTATIONS)
    unknown = [n for n in names if n not in MUTATIONS]
    if unknown:
        raise SystemExit(f"unknown mutations {unknown}; known: {list(MUTATIONS)}")
    sys.exit(0 if all([run(name) for name in names]) else 1)
