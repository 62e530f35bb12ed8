"""The plan's step-time model per mode, the node check, and the calibration that measures the rates here."""
import json
import math
import os
from itertools import product

import pytest

from ds_pseudo_real.cli import main as cli_main
from ds_pseudo_real.offload import calibrate as calibration
from ds_pseudo_real.offload.planner import PlacementLevel, TrainingSetup, place, uniform_groups
from ds_pseudo_real.offload.step_time import Compute, NodeFit, describe_node_fit, group_work, step_times

GIB = 2**30
HOST_OPTIMIZER, HOST_PARAMS = PlacementLevel.HOST_OPTIMIZER, PlacementLevel.HOST_PARAMS
# M6-10T's V100 plan: host memory per rank, pinned (benchmarks/results/m6_10t_v100_plan.txt)
M6_HOST_BYTES = 330448650240


def small_plan(levels, ga=1, stage=2):
    """4 fp32 layers of 1000 params at ZeRO ``stage`` on one rank; PCIe 4000 B/s and 1000 host Adam params/s make
    the seconds round."""
    setup = TrainingSetup("fp32", stage, pcie_bytes_per_s=4000, cpu_adam_params_per_s=1000,
                          gradient_accumulation_steps=ga)
    return place(uniform_groups(4, 1000), levels, setup)


# 1000 params a token meets x 500 tokens, 2 FLOPs each at 1e6 FLOP/s: a 1 s forward, a 2 s backward
COMPUTE = Compute(1000, 500, 1e6)


def test_each_mode_on_a_plan_computed_by_hand():
    plan = small_plan({"layer2": HOST_OPTIMIZER, "layer3": HOST_PARAMS})
    # layer3 (host_params, ZeRO 2: stepped by the offload during the backward): its params in for the forward and
    # the backward (4000 B each), its gradient out (4000 B), 1000 params stepped; layer2 (host_optimizer, in
    # DeepSpeed's optimizer: after the backward): gradient out, master in (4000 B each), 1000 params
    assert [tuple(w) for w in group_work(plan)] == [("layer3", 3, 8000, 4000, 0, 1000, True),
                                                    ("layer2", 2, 0, 4000, 4000, 1000, False)]
    assert (plan.transfer_seconds, plan.host_adam_seconds) == (5.0, 2.0)
    times = step_times(plan, COMPUTE)
    # forward max(1, 4000 B / 4000 B/s) = 1 s; backward max(2, 1) = 2 s, ending at 3 s. sequential: from 3 s,
    # layer3 out 1, Adam 2; layer2 out 2, Adam 3, master in 4: 7 s
    assert (times.forward, times.backward, times.sequential) == (1.0, 2.0, 7.0)
    # overlapped: the backward passes layer3 at 1 + 2 / 4 = 1.5 s: out 2.5, Adam 3.5; layer2 at the backward's end
    # (3 s): out 4, Adam 5, master in 6
    assert times.overlapped == 6.0 and times.overlapped_ratio == 6.0 / 7.0
    # delayed: layer3's gradient out during the backward as overlapped (2.5), its Adam on the step before's gradient
    # from 0 (1); layer2, in DeepSpeed's optimizer, after the backward: out 4, Adam 5, in 6
    assert times.delayed == 6.0
    # with every offloaded layer the offload's own, the delayed step is the compute's: max(3, out 2.5, Adam 1)
    assert step_times(small_plan({"layer3": HOST_PARAMS}), COMPUTE).delayed == 3.0


def test_delayed_step_is_the_host_adam_when_that_is_the_longest():
    # every layer host_params: the fetches (4 x 4000 B each way, 4 s) make the forward and the backward 4 s each;
    # the backward passes the layers at 5, 6, 7, 8 s, each gradient out in 1 s: the last leaves at 9 s, after the
    # host Adam of the step before (4 x 1000 params at 1000/s = 4 s)
    plan = small_plan({f"layer{i}": HOST_PARAMS for i in range(4)})
    times = step_times(plan, COMPUTE)
    assert (times.forward, times.backward, times.delayed) == (4.0, 4.0, 9.0)
    quick = Compute(1000, 500, 1e6)
    fast_pcie = place(uniform_groups(4, 1000), {f"layer{i}": HOST_PARAMS for i in range(4)},
                      TrainingSetup("fp32", 2, pcie_bytes_per_s=4e6, cpu_adam_params_per_s=1000))
    # with copies a thousand times faster, the host Adam of the step before (4 s) is the step
    assert step_times(fast_pcie, quick).delayed == pytest.approx(4.0)


def test_a_step_late_deepspeeds_groups_share_the_host_with_the_late_step():
    # PCIe at 4 MB/s (copies of a millisecond), host Adam 100 params/s: layer3 (host_params, stepped late) 10 s
    # from 0, layer2 (host_optimizer, DeepSpeed's) 10 s from when its gradient is out, at 3.001 s, beside the
    # late step's remaining 6.999 s: both at half speed until 16.999 s, layer2 alone to 20, its master in at 20.001
    # (alone it would end at 13.002: 6.999 s later); the host is busy from 0 to 20 s
    setup = TrainingSetup("fp32", 2, pcie_bytes_per_s=4e6, cpu_adam_params_per_s=100)
    plan = place(uniform_groups(4, 1000), {"layer2": HOST_OPTIMIZER, "layer3": HOST_PARAMS}, setup)
    times = step_times(plan, COMPUTE)
    assert times.delayed == pytest.approx(20.001)
    # overlapped: layer3 from 1.501 s to 11.501 s, then layer2 to 21.501 s and its master in; sequential: the
    # backward's 3 s, then 2 x (10 s of host Adam + a copy out) and a master in
    assert times.overlapped == pytest.approx(21.502) and times.sequential == pytest.approx(23.002)


def test_at_zero_0_nothing_is_stepped_during_the_backward():
    # fp32 ZeRO 0 keeps host_params layers in DeepSpeed's optimizer, which gets their gradients after the backward
    plan = small_plan({"layer2": HOST_OPTIMIZER, "layer3": HOST_PARAMS}, stage=0)
    assert [w.during_backward for w in group_work(plan)] == [False, False]
    times = step_times(plan, COMPUTE)
    assert times.overlapped == times.sequential == 7.0


def test_gradient_accumulation_delays_the_host_work_to_the_last_backward():
    plan = small_plan({"layer3": HOST_PARAMS}, ga=2)
    # fetched in every micro-batch's forward and backward: 16000 B; its gradient streamed out in each micro-batch
    # (8000 B), 1000 params stepped once
    assert [tuple(w) for w in group_work(plan)] == [("layer3", 3, 16000, 8000, 0, 1000, True)]
    times = step_times(plan, COMPUTE)
    # the last backward starts at 2 x 1 + 2 = 4 s and ends at 6 s; sequential: out 2, Adam 3 after it
    assert (times.forward, times.backward, times.sequential) == (2.0, 4.0, 9.0)
    # overlapped: the backward passes layer3 at 4.5 s: out 6.5, Adam 7.5 (the first micro-batch's gradient is
    # counted with the last: an upper bound); delayed: the same copy out ends at 6.5, the Adam of the step before
    # at 1
    assert times.overlapped == 7.5 and times.delayed == 6.5


def test_overlapped_between_the_backward_and_sequential_for_every_placement():
    for chosen in product([PlacementLevel.DEVICE, HOST_OPTIMIZER, HOST_PARAMS], repeat=4):
        plan = small_plan({f"layer{i}": level for i, level in enumerate(chosen)})
        for compute in (COMPUTE, Compute(1000, 50, 1e6), Compute(1000, 5000, 1e6, recompute=True)):
            times = step_times(plan, compute)
            assert times.backward <= times.overlapped <= times.sequential + 1e-12, chosen
            assert times.forward + times.backward <= times.delayed <= times.sequential + 1e-12, chosen


def test_nothing_on_the_host_is_the_compute_in_every_mode():
    times = step_times(small_plan({}), COMPUTE)
    assert times == (1.0, 2.0, 3.0, 3.0, 3.0)


def test_delayed_hides_a_host_step_shorter_than_the_forward_and_backward():
    plan = small_plan({"layer2": HOST_PARAMS})  # fetched in 1 s each way, 1 s out, 1 s Adam
    long = Compute(1000, 5000, 1e6)  # 10 s forward, 20 s backward
    times = step_times(plan, long)
    assert times.delayed == 30.0 and times.sequential == 32.0
    # the backward passes layer2 at 10 + 20 x 2 / 4 = 20 s; its 2 s of host work end before the backward does
    assert times.overlapped == 30.0


def test_node_check_refuses_naming_the_ranks_that_fit():
    dgx1 = NodeFit(8, M6_HOST_BYTES, 512 * GIB)
    assert not dgx1.fits and dgx1.needed() == 8 * (M6_HOST_BYTES + 4 * GIB) + 16 * GIB
    assert dgx1.most_ranks == 1  # (512 - 16) GiB // (307.75 + 4) GiB
    line = describe_node_fit(dgx1, "DGX-1")
    assert line.startswith("DGX-1: 8 ranks x (307.75 GiB plan + 4.00 GiB process) + 16.00 GiB reserve = 2.45 TiB of "
                           "host memory, above the node's 512.00 GiB: does not fit; at most 1 rank per node fits "
                           "(327.75 GiB), or put the optimizer state on NVMe")
    assert NodeFit(16, M6_HOST_BYTES, 1536 * GIB).most_ranks == 4
    one = NodeFit(1, M6_HOST_BYTES, 512 * GIB)
    assert one.fits and describe_node_fit(one).endswith("within the node's 512.00 GiB: fits")
    assert "not even one rank fits" in describe_node_fit(NodeFit(2, 600 * GIB, 512 * GIB))


def test_calibration_measures_this_machine():
    lines = []
    measured = calibration.calibrate(1, numel=4 * 2**20, repeats=3, progress=lines.append)
    assert 1e6 < measured.cpu_adam_params_per_s < math.inf
    meminfo = open("/proc/meminfo").read()
    total = int(meminfo.split("MemTotal:")[1].split()[0]) * 1024
    assert measured.node_memory_bytes == total > GIB
    assert measured.node_cores == len(os.sched_getaffinity(0)) == measured.cpu_adam_threads
    assert 0 < measured.cpu_share <= 1.5
    if measured.device == "cpu":
        assert measured.pcie_bytes_per_s is None and any("PCIe: not measured" in line for line in lines)
    assert sum("host Adam" in line and "step" in line for line in lines) == 4  # a warm-up and 3 timed steps


def _thread_ticks():
    """CPU clock ticks (user + system) of each thread of this process."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


def test_the_thread_count_reaches_the_kernel():
    """torch.set_num_threads sets the OpenMP team DeepSpeed's kernel runs on: with 2 threads two of the process's
    threads do its work, with 1 only one. A machine busy with other work can starve one thread of a run, so each
    count has three runs to show it."""
    calibration.cpu_adam_rate(1, numel=2**20, repeats=1)  # the op loaded, the buffers' pages known
    for threads in (1, 2):
        seen = []
        for _ in range(3):
            before = _thread_ticks()
            calibration.cpu_adam_rate(threads, numel=8 * 2**20, repeats=4)
            after = _thread_ticks()
            seen.append(sorted(after[tid] - before.get(tid, 0) for tid in after if after[tid] > before.get(tid, 0)))
            if sum(ticks >= 2 for ticks in seen[-1]) == threads:
                break
        else:
            raise AssertionError(f"{threads} thread(s) asked, the threads' ticks in three runs: {seen}")


def write_config(tmp_path):
    """Four fp32 layers of 1000 params, layer2 at host_optimizer and layer3 at host_params, the rates of
    small_plan, and 500 tokens a micro-batch: with 4000 params a token meets at --gpu-tflops 4e-6, the compute of
    COMPUTE."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "granular_offload": {
        "levels": {"2": "host_optimizer", "3": "host_params"}, "pcie_gb_per_s": 4e-6, "cpu_adam_params_per_s": 1000,
        "activations": {"micro_batch": 1, "seq_len": 500, "hidden": 8, "heads": 1},
        "model": {"num_layers": 4, "layer_params": 1000}}}))
    return str(path)


def plan(config, *flags):
    return cli_main(["plan", "--config", config, "--accelerator", "cpu", "--gpu-tflops", "4e-6", *flags])


def test_plan_command_prints_each_mode_and_the_node(tmp_path, capsys):
    config = write_config(tmp_path)
    assert plan(config, "--ranks-per-node", "2", "--host-memory-per-node", "40GiB") == 0
    out = capsys.readouterr().out
    assert ("rates: host Adam 1e+03 params/s (assumed: granular_offload.cpu_adam_params_per_s), PCIe 4e-06 GB/s "
            "(assumed: granular_offload.pcie_gb_per_s), device 4e-06 TFLOPS (assumed: --gpu-tflops; 4,000 parameters "
            "a token meets x 500 tokens a micro-batch)\n") in out
    assert ("modelled step: forward 1 s, backward 2 s; host_step sequential (the host step after the backward) 7 s, "
            "overlapped (host_params layers stepped during the backward) 6 s = 0.86 x sequential, delayed (stepped "
            "one step late, during the next forward and backward) 6 s\n") in out
    # host: layer2's master, gradient buffer and moments, layer3's params, gradient buffer and moments: 4 x 4000 B
    # each, unpinned on the CPU
    assert ("node: 2 ranks x (31.25 KiB plan + 4.00 GiB process) + 16.00 GiB reserve = 24.00 GiB of host memory, "
            "within the node's 40.00 GiB: fits") in out


def test_plan_command_calibrates_saves_and_reuses(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(calibration, "ADAM_NUMEL", 4 * 2**20)
    config, saved = write_config(tmp_path), tmp_path / "calibration.json"
    assert plan(config, "--calibrate", "--calibration-out", str(saved)) == 0
    captured = capsys.readouterr()
    measured = calibration.Calibration.load(str(saved))
    assert "calibrating:" in captured.err and f"wrote {saved}" in captured.err
    rate = f"host Adam {measured.cpu_adam_params_per_s:.3g} params/s (measured on {measured.host}, "
    assert rate in captured.out
    assert f"node (measured on {measured.host}: {measured.node_cores} cores): 1 rank x" in captured.out
    # reused: the same figures, nothing measured
    assert plan(config, "--calibration", str(saved), "--ranks-per-node", "3") == 0
    again = capsys.readouterr()
    assert rate in again.out and "3 ranks x" in again.out and "calibrating" not in again.err


@pytest.mark.parametrize("flags, error", [
    (["--ranks-per-node", "0"], "argument --ranks-per-node: expected an integer >= 1, got '0'"),
    (["--gpu-tflops", "0"], "argument --gpu-tflops: expected a number > 0, got '0'"),
    (["--gpu-tflops", "fast"], "argument --gpu-tflops: expected a number > 0, got 'fast'"),
    (["--host-memory-per-node", "lots"], "argument --host-memory-per-node: expected a byte count like"),
])
def test_bad_flags_name_the_flag(tmp_path, capsys, flags, error):
    with pytest.raises(SystemExit):
        plan(write_config(tmp_path), *flags)
    assert error in capsys.readouterr().err


@pytest.mark.parametrize("flags, error", [
    (["--host-memory-per-node", "512GiB"], "--host-memory-per-node: the node check needs --ranks-per-node too"),
    (["--ranks-per-node", "8"], "--ranks-per-node: got 8; the node check needs the node's memory: "
                                "--host-memory-per-node, --calibrate or --calibration"),
    (["--calibration-out", "x.json"], "--calibration-out: got 'x.json' without --calibrate"),
    (["--calibrate", "--calibration", "x.json"], "--calibration: got 'x.json' with --calibrate; accepted: one"),
    (["--calibration", "/nonexistent.json"], "--calibration: cannot read /nonexistent.json"),
])
def test_inconsistent_flags_are_refused_in_one_line(tmp_path, capsys, flags, error):
    assert plan(write_config(tmp_path), *flags) == 2
    err = capsys.readouterr().err
    assert error in err and len(err.strip().splitlines()) == 1


def test_a_file_that_is_no_calibration_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cpu_adam_params_per_s": 1e9, "speed": 2}))
    assert plan(write_config(tmp_path), "--calibration", str(bad)) == 2
    assert (f"--calibration: {bad} is not a calibration file (missing keys ['cpu_adam_threads', 'cpu_share', "
            f"'node_cores', 'node_memory_bytes', 'ranks_per_node'], unknown keys ['speed'])") in capsys.readouterr().err
