"""The real paths on a fake GPU rank under the fake NCCL: DeepSpeed's own engine (its CUDA accelerator, over the fake
devices), the main job's training loop, the delink at ZeRO 0-3, a PipelineModule with granular offload, and the
Megatron drop-in's delink with Megatron's DDP and optimizers; fp16 with dynamic loss scaling in the main job (with
host_params), the delink and the drop-in (fp16 weights on cuda:3, the scaler's overflow checks reduced there).

Each runs as local rank 3 of a node with 8 GPUs and fails if an op mixes devices, a collective gets a host tensor
or another GPU's, work reads what another stream (or a copy to the host) writes before waiting for it, a block is
freed while another stream uses it, or any tensor, stream, event or work lands on another GPU than cuda:3.

What the fake process group cannot do decides two things here. It moves no data between ranks, so values computed
from other ranks' data are this rank's own, and a check that compares what rank 0 broadcast with what this rank
holds can pass on rank 0 only: ZeRO 3 (whose ``assert_ints_same_as_other_ranks`` does that) runs as group rank 0
of 8, still on GPU 3. A pipeline's first stage is driven: a later stage would wait for the first stage's activation
shapes, which the fake group never sends."""
import json
import signal
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gpu_contracts.fakes import FakeGpuRank, FakeNccl

TESTS = Path(__file__).resolve().parents[1]
for folder in ("offload", "scripts", "megatron/workers"):
    sys.path.insert(0, str(TESTS / folder))
from tiny_model import TinyLM, batch  # noqa: E402

import ds_pseudo_real  # noqa: E402
from ds_pseudo_real import ds_state, stages  # noqa: E402

CUDA3 = torch.device("cuda", 3)
WORLD = 8


@pytest.fixture
def fake_world(request):
    """Local rank 3 of 8 fake GPUs in a fake NCCL world of 8, as group rank ``request.param`` (default 3)."""
    group_rank = getattr(request, "param", 3)
    with FakeGpuRank(local_rank=3, device_count=WORLD) as rank, FakeNccl(rank, group_rank, WORLD) as nccl:
        yield rank, nccl
        # nothing ran anywhere but on this rank's GPU, and nothing was left for the host to read unwaited
        assert rank.touched == {CUDA3}
        assert {a.device for a in rank.allocations} == {CUDA3}
        assert rank.misplaced_work() == [] and rank.unwaited_copies() == []
        assert nccl.calls and all(devices == [CUDA3] * len(devices) for _, devices in nccl.calls)


def tiny_config(stage, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    cfg.update(extra)
    return cfg


# ---- the main job ---------------------------------------------------------------------------------------------
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 1}
MAIN_JOB_CASES = {
    "zero1": (1, None, 3, "fp32"),
    "zero2_host_params": (2, {"0": "host_params", "1": "host_optimizer"}, 3, "fp32"),
    "zero0_host_params": (0, {"0": "host_params", "1": "host_optimizer"}, 3, "fp32"),
    "zero3": (3, None, 0, "fp32"),
    "zero2_host_params_bf16": (2, {"0": "host_params", "1": "host_optimizer"}, 3, "bf16"),
    "zero2_host_params_fp16": (2, {"0": "host_params", "1": "host_optimizer"}, 3, "fp16"),
    # layer 0 stepped by the worker thread during the backward (its copies and events from another thread)
    "zero2_host_step_overlapped_fp16": (2, {"0": "host_params", "1": "host_optimizer", "host_step": "overlapped"},
                                        3, "fp16"),
    # layer 0 stepped one step late by a worker thread, during the next forward and backward
    "zero2_host_step_delayed_fp16": (2, {"0": "host_params", "1": "host_optimizer", "host_step": "delayed",
                                         "delayed_from_step": 0}, 3, "fp16"),
}


def train_main_job(config: Path, output_dir: Path) -> int:
    """``launch/train.py``'s ``train`` of a 4-layer GPT on ``config`` for 4 steps into ``output_dir``, evaluating 2
    batches every 2 steps; the signal handlers it installs are put back after. Returns its exit code."""
    from launch import train as main_job

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        args = main_job.parse_args([
            "--deepspeed_config", str(config), "--output-dir", str(output_dir), "--steps", "4",
            "--eval-interval", "2", "--eval-batches", "2", "--n-layer", "4", "--d-model", "32", "--n-head", "2",
            "--seq-len", "16", "--corpus-bytes", "200000"])
        return main_job.train(args)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("fake_world,stage,levels,dtype", [
    pytest.param(group_rank, stage, levels, dtype, id=name)
    for name, (stage, levels, group_rank, dtype) in MAIN_JOB_CASES.items()], indirect=["fake_world"])
def test_the_main_jobs_loop_runs_on_the_ranks_gpu(fake_world, stage, levels, dtype, tmp_path, monkeypatch):
    """``launch/train.py``'s ``train`` for 4 steps, delinking at step 2, evaluating at steps 2 and 4 and saving at
    the end: every loss and evaluation sum is all-reduced on cuda:3 (in bf16 and fp16 too, the gradients cast back
    through the loss's fp32 on the GPU)."""
    from launch import trainer

    rank, nccl = fake_world
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": stage},
           "pseudo_to_real": {"groups": 1, "switch": {"at_step": 2}, "optimizer_state": "scale"}}
    stepped_ahead, stepped_late = [], []
    if levels:
        levels = dict(levels)
        host_step = levels.pop("host_step", "sequential")
        cfg["granular_offload"] = {"levels": levels, "host_step": host_step}
        if "delayed_from_step" in levels:
            cfg["granular_offload"]["delayed_from_step"] = levels.pop("delayed_from_step")
        del cfg["optimizer"]["params"]["torch_adam"]  # granular offload steps with DeepSpeed's kernels
        from ds_pseudo_real.offload.ahead import HostStepAhead

        from ds_pseudo_real.offload.delayed import DelayedHostStep

        step_ahead, step_late = HostStepAhead._step, DelayedHostStep._step
        monkeypatch.setattr(HostStepAhead, "_step", lambda self, *a: (stepped_ahead.append(a[0]["placement"]),
                                                                       step_ahead(self, *a)))
        monkeypatch.setattr(DelayedHostStep, "_step", lambda self, work, factor: (
            stepped_late.append(sorted({group["placement"] for group, *_ in work})), step_late(self, work, factor)))
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = FP16
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    summed = []
    sum_over_ranks = trainer.sum_over_ranks

    def spy(values, device):
        summed.append((len(values), device))
        return sum_over_ranks(values, device)

    monkeypatch.setattr(trainer, "sum_over_ranks", spy)
    assert train_main_job(tmp_path / "c.json", tmp_path / "run") == 0
    # the overlapped host step: layer 0 of the pseudo model (the first step learns) and of the real one (the delink
    # builds a new optimizer, which learns at step 3), stepped ahead at steps 2 and 4
    overlapped = cfg.get("granular_offload", {}).get("host_step") == "overlapped"
    assert stepped_ahead == (["layer0"] * 2 if overlapped else [])
    # the delayed host step: layer 0 at every step, of the pseudo model (steps 1 and 2) and of the real one (the
    # delink publishes the step in flight first)
    delayed = cfg.get("granular_offload", {}).get("host_step") == "delayed"
    assert stepped_late == ([["layer0"]] * 4 if delayed else [])
    # 4 steps' loss sums (with the stop flag) and 2 evaluations, each one all-reduce of a tensor on cuda:3
    assert summed == [(2, CUDA3)] * 2 + [(1, CUDA3)] + [(2, CUDA3)] * 2 + [(1, CUDA3)]
    # the last step's checkpoint: this rank's partition of the optimizer state under ZeRO (rank 0 publishes the
    # folder once every rank wrote its own; at ZeRO 0 rank 0 writes everything)
    folder, = (tmp_path / "run" / "checkpoints").glob("global_step4*")
    assert stage == 0 or list(folder.glob(f"*_rank_{nccl.group_rank}_*optim_states.pt"))
    if nccl.group_rank == 0:  # rank 0 writes the metrics: the delink at step 2, evaluations at 2 and 4
        records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "step" in r and "event" not in r]
        assert [(r["step"], r["stage"], "val_loss" in r) for r in steps] == [
            (1, "pseudo", False), (2, "pseudo", True), (3, "real", False), (4, "real", True)]


# ---- the delink -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fake_world,stage,fp16", [(3, 0, None), (3, 1, None), (3, 2, None), (0, 3, None),
                                                   (3, 1, FP16), (0, 3, FP16)], indirect=["fake_world"],
                         ids=["zero0", "zero1", "zero2", "zero3", "zero1_fp16", "zero3_fp16"])
def test_the_delink_runs_on_the_ranks_gpu(fake_world, stage, fp16, monkeypatch):
    """The delink's gathered fp32 weights and moments wait on the host, the device keeping none of them, and
    ``delink_noise`` makes one noisy copy at a time, on the host, each written into its layer and dropped. In fp16 the
    real model's weights are fp16 on cuda:3 and the loss scaler goes on (doubled after every step here)."""
    rank, _ = fake_world
    gathered, noisy, held = {}, [], []
    gather, read = stages.ds_state.gather_full_state, stages.Starts.__getitem__

    def gather_spy(engine, *args):
        before = rank.live_bytes(3)
        weights, moments = gather(engine, *args)
        gathered.update(weights=weights, moments=moments, kept=rank.live_bytes(3) - before)
        return weights, moments

    def read_spy(starts, name):
        held.append(sum(ref() is not None for ref in noisy))  # noisy copies still alive when one more is made
        value = read(starts, name)
        if starts.made_on_read(name):
            noisy.append(weakref.ref(value))
            assert value.device.type == "cpu"
        return value

    monkeypatch.setattr(stages.ds_state, "gather_full_state", gather_spy)
    monkeypatch.setattr(stages.Starts, "__getitem__", read_spy)
    torch.manual_seed(0)
    cfg = tiny_config(stage, pseudo_to_real={"layers": "layers", "switch": {"at_step": 2}, "delink_noise": 0.01})
    if fp16:
        cfg["fp16"] = fp16
    engine, *_ = ds_pseudo_real.initialize(model=TinyLM(), config=cfg)
    losses = []
    for step in range(3):
        x, y = batch(step, 3)
        loss = engine(x.to(CUDA3), y.to(CUDA3))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.stage == "real" and torch.isfinite(torch.tensor(losses)).all()
    assert all(p.device == CUDA3 for p in engine.module.parameters())
    if fp16:  # 2**8, doubled at steps 2 and 3 (window 1): 2**8 again had the real engine started a scaler afresh
        assert {p.dtype for p in engine.module.parameters()} == {torch.float16}
        assert ds_state.loss_scaler_state(engine.engine)["cur_scale"] == 2**10 and engine.skipped_steps == 0
    tensors = [*gathered["weights"].values(), *(t for per in gathered["moments"].values() for t in per.values())]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert gathered["kept"] <= 0  # what DeepSpeed handed over on the device is freed
    # layers 1-3's 6 parameters each, one at a time (in fp16 made again, the same, for the layer's fp32 master)
    assert len(noisy) == 3 * 6 * (2 if fp16 else 1) and max(held) == 0
    engine.engine.destroy()


# ---- DeepSpeed's pipeline engine ------------------------------------------------------------------------------
def test_a_pipeline_with_granular_offload_runs_on_the_ranks_gpu(fake_world, monkeypatch):
    """Stage 0 of 2 x 4 data-parallel ranks: the pseudo stage's tied set at host_optimizer (ZeRO 1) and each stage's
    own set at host_params (ZeRO 0), through the delink at step 3; the first again with its host_params layer stepped
    a step late (host_step "delayed", from step 0): the pseudo stage has no layer the offload steps itself (its set
    is at host_optimizer), the real one's layer 2 is stepped by the worker at steps 4 and 5; and host_params for the
    set both stages hold, refused on every stage after an all-reduce on the device."""
    import deepspeed
    import pipeline_delink as pd
    from ds_pseudo_real.config import ConfigError
    from ds_pseudo_real.offload.delayed import DelayedHostStep

    stepped_late = []
    step_late = DelayedHostStep._step
    monkeypatch.setattr(DelayedHostStep, "_step", lambda self, work, factor: (
        stepped_late.append(sorted({group["placement"] for group, *_ in work})), step_late(self, work, factor)))
    deepspeed.init_distributed()
    torch.cuda.set_device(3)
    for zero, groups, offload, host_step in ((1, 1, "spanning", None), (0, 2, "in_stage", None),
                                             (1, 1, "spanning", "delayed")):
        config = pd.config(zero, groups, "copy", "fp32", offload)
        if host_step:
            config["granular_offload"].update(host_step=host_step, delayed_from_step=0)
        engine, *_ = ds_pseudo_real.initialize(model=pd.pipeline_module(), config=config)
        assert engine.engine.stage_id == 0 and engine.offload_plan is not None
        for step in range(1, 6):
            assert engine.train_batch(iter(pd.batches(step, 0))).device == CUDA3
        assert engine.stage == "real" and engine.offload_plan is not None
        engine.destroy()  # the step in flight (step 5's) finished and published
    assert stepped_late == [["layer2"], ["layer2"]]
    refused = pd.config(1, 1, "copy", "fp32", "no_offload")
    refused["granular_offload"] = {"levels": {"1": "host_params"}}
    with pytest.raises(ConfigError, match="a module that other pipeline stages hold too"):
        ds_pseudo_real.initialize(model=pd.pipeline_module(), config=refused)


# ---- the Megatron drop-in -------------------------------------------------------------------------------------
def drop_in_args(distributed_optimizer: bool) -> SimpleNamespace:
    """Megatron-LM's arguments the drop-in reads: 4 layers sharing one set, the switch at iteration 2 of 4, the
    copy policy, no checkpoints."""
    return SimpleNamespace(pseudo_to_real_switch_iter=2, pseudo_to_real_groups=1, num_layers=4,
                           pseudo_to_real_real_layout=None, m6_expert_prototypes=None, save=None, load=None,
                           ckpt_step=None, train_iters=4, virtual_pipeline_model_parallel_size=None,
                           use_distributed_optimizer=distributed_optimizer,
                           dist_ckpt_optim_fully_reshardable=False, pseudo_to_real_optimizer_state="copy",
                           curr_iteration=0)


def megatron_setup(cfg, distributed_optimizer: bool, fp16: bool):
    """Megatron-LM's ``setup_model_and_optimizer`` on the current device: the provider's model in Megatron's
    DistributedDataParallel (overlapped gradient reduction; in Float16Module for fp16) and its Adam (clip 1.0, in
    fp16 a dynamic loss scale from 2**10, window 1)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    def setup_model_and_optimizer(model_provider, model_type):
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                                   use_distributed_optimizer=distributed_optimizer)
        module = model_provider().cuda()
        chunks = [DistributedDataParallel(config=cfg, ddp_config=ddp_config,
                                          module=Float16Module(cfg, module) if fp16 else module)]
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, fp16=fp16,
                                                           initial_loss_scale=2**10, loss_scale_window=1,
                                                           use_distributed_optimizer=distributed_optimizer),
                                           chunks)
        return chunks, optimizer, None
    return setup_model_and_optimizer


def summed_logits_step(tokens, positions, mask):
    """A Megatron ``forward_step`` on one fixed batch: the loss is the sum of the model's output (as float), its
    element count on the device and that sum reported as ``lm loss``."""
    def forward_step(data, chunk):
        out = chunk(tokens, positions, mask, labels=torch.roll(tokens, -1, 1))
        return out, lambda o: (o.float().sum(), torch.tensor(o.numel(), dtype=torch.int, device="cuda"),
                               {"lm loss": o.float().sum().detach()})
    return forward_step


def megatron_train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config):
    """Megatron-LM's ``train_step`` reduced to its work: gradients zeroed, 2 micro-batches forward and backward
    through Megatron's schedule, one optimizer step; returns the summed ``lm loss``."""
    import mcore_setup as ms
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model, num_microbatches=2,
        seq_length=ms.SEQ, micro_batch_size=ms.BATCH, forward_only=False)
    optimizer.step()
    return float(sum(r["lm loss"] for r in reports))


@pytest.mark.parametrize("distributed_optimizer,fp16", [(True, False), (False, False), (True, True)],
                         ids=["distributed_optimizer", "ddp", "distributed_optimizer_fp16"])
def test_the_megatron_drop_ins_delink_runs_on_the_ranks_gpu(fake_world, distributed_optimizer, fp16):
    """The drop-in's own delink (``PseudoToRealRun.train_step``, its model provider and ``delink``) on megatron-core's
    GPTModel under its DistributedDataParallel (overlapped gradient reduction) and optimizer, built and stepped on
    cuda:3 with Megatron's own CUDA code (no CPU compatibility layer): 4 iterations, the switch at iteration 2. In
    fp16 (Megatron's Float16Module and grad scaler, its found-inf reduced on cuda:3) the scale goes on across it."""
    import mcore_setup as ms
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from megatron_patches.run import PseudoToRealRun, StageLayout

    rank, nccl = fake_world
    torch.cuda.set_device(3)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        model_parallel_cuda_manual_seed(1)
        cfg = ms.config(num_layers=4, use_cpu_initialization=False, fp16=fp16)
        args = drop_in_args(distributed_optimizer)
        setup_model_and_optimizer = megatron_setup(cfg, distributed_optimizer, fp16)
        run = PseudoToRealRun(SimpleNamespace(setup_model_and_optimizer=setup_model_and_optimizer), lambda: args,
                              lambda *a, **k: ms.gpt(cfg, None, seed=3), None, StageLayout())
        model, optimizer, _ = setup_model_and_optimizer(run.model_provider, None)

        def gpt(chunk):
            return chunk.module.module if fp16 else chunk.module

        pseudo = gpt(model[0])
        tokens, positions, mask, _ = (t.cuda() if t is not None else None for t in ms.batch(seed=7))
        forward_step = summed_logits_step(tokens, positions, mask)
        config = model[0].config
        config.grad_scale_func, config.finalize_model_grads_func = optimizer.scale_loss, finalize_model_grads
        config.no_sync_func, config.grad_sync_func = model[0].no_sync, model[0].start_grad_sync
        step = run.train_step(megatron_train_step)
        losses = []
        for iteration in range(4):
            args.curr_iteration = iteration
            losses.append(step(forward_step, iter([None, None]), model, optimizer, None, config))
        real = gpt(model[0])
        assert real is not pseudo and not run.pseudo_stage and torch.isfinite(torch.tensor(losses)).all()
        layer_weights = [layer.self_attention.linear_qkv.weight for layer in real.decoder.layers]
        assert len({id(w) for w in layer_weights}) == 4 and all(w.device == CUDA3 for w in layer_weights)
        if fp16:  # doubled after each of the 4 iterations (window 1); a scaler started afresh at the switch: 2**12
            assert {w.dtype for w in layer_weights} == {torch.float16}
            assert optimizer.get_loss_scale().item() == 2**14
        assert config.grad_scale_func == optimizer.scale_loss  # the train hooks follow the new optimizer
        if distributed_optimizer:  # its gloo groups (checkpoint gathers) stay apart from NCCL's checks
            assert nccl.calls and {op for op, _ in nccl.calls} >= {"c10d::reduce_scatter_tensor_coalesced_"}
    finally:
        get_cuda_rng_tracker().reset()
        parallel_state.destroy_model_parallel()
