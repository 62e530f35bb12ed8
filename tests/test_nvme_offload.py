"""The delink under ZeRO-3 with the optimizer state swapped to NVMe (ZeRO-Infinity's ``offload_optimizer: nvme``):
DeepSpeed keeps each sub-group of 1 MiB or more (its fp32 master and Adam moments) in files and reads one into memory
at a time. The delink must read the pseudo state and write the real one a sub-group at a time, each once, and train
on exactly as with the state offloaded to host memory (the same CPU Adam)."""
import json
import sys
from pathlib import Path

import pytest
import torch

import ds_pseudo_real
from conftest import run_two_ranks
from ds_pseudo_real import ds_state

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import nvme_delink  # noqa: E402
from delink_matrix import fixed_batch  # noqa: E402
from nvme_delink import carried_moments_check, offload_config, train  # noqa: E402

D_MODEL = nvme_delink.width(1)


@pytest.fixture(scope="module")
def async_io():
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed's async_io op cannot build here: it needs libaio (apt-get install libaio-dev)")
    AsyncIOBuilder().load(verbose=False)


@pytest.mark.parametrize("policy, dtype", [("copy", "fp32"), ("scale", "fp32"), ("copy", "bf16")])
def test_delink_with_the_optimizer_state_on_nvme_trains_on_as_with_it_on_the_host(async_io, tmp_path, policy, dtype):
    """bf16: the fp32 masters the delink sets from the full pseudo values are in the swapped sub-groups too."""
    host_losses, host, *_ = train(offload_config("cpu", str(tmp_path), policy, dtype), D_MODEL)
    host_moments = {n: ds_state.full_moments(host.engine, p, n) for n, p in host.module.named_parameters()}
    host.engine.destroy()
    losses, engine, recorder, _ = train(offload_config("nvme", str(tmp_path / "swap"), policy, dtype), D_MODEL)
    assert engine.engine.optimizer.swap_optimizer and nvme_delink.swappable_sub_groups(engine) >= 3
    assert recorder.pseudo and recorder.swapped == 1
    assert losses == host_losses  # bit for bit: the same CPU Adam on the same state, in files or in memory
    # and so are the moments, two real steps after the delink; except the idle parameters': DeepSpeed 0.19.8 reads a
    # swapped sub-group's gradients into a reused buffer and leaves a parameter that got none with what the buffer
    # held (the same model trained with pseudo_to_real disabled gets the same nonzero moments: DeepSpeed's, see
    # benchmarks/README.md, "ZeRO-3 with the optimizer state on NVMe"); right after the delink they are zero (the
    # test below)
    for name, param in engine.module.named_parameters():
        if not name.endswith("idle"):
            moments = ds_state.full_moments(engine.engine, param, name)
            assert all(torch.equal(moments[k], host_moments[name][k]) for k in ds_state.MOMENT_KEYS), name
    engine.engine.destroy()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_delink_writes_the_swapped_moments_once_a_sub_group_at_a_time(async_io, tmp_path, dtype):
    """The moments carried into each real parameter are the pseudo ones, what has no source is zero, nothing is
    left unwritten (NaN); and each swapped sub-group is read once (the pseudo ones, to gather their state) and
    read and written once (the real ones, to seed and write theirs; in bf16 once more, to set the fp32 masters from
    the full pseudo values), not once per parameter."""
    _, engine, recorder, during = train(offload_config("nvme", str(tmp_path), dtype=dtype), D_MODEL, steps=2)
    real_swapped, pseudo_swapped = nvme_delink.swappable_sub_groups(engine), recorder.swapped
    assert real_swapped >= 3 and pseudo_swapped == 1
    # the gather reads the pseudo sub-group once; DeepSpeed's engine build swaps each real one in and out once,
    # (bf16: setting the masters once) and the carry once
    passes = 2 + (dtype == "bf16")
    assert during == {"in": pseudo_swapped + passes * real_swapped, "out": passes * real_swapped}
    assert carried_moments_check(engine, recorder.pseudo) == []
    engine.engine.destroy()


@pytest.fixture(scope="module")
def two_ranks(async_io, tmp_path_factory):
    """The folder of one two-rank launch of scripts/nvme_resume.py's run phase, which first runs
    scripts/nvme_delink.py's two-rank cases in the same processes: the results and checkpoints of both."""
    out = tmp_path_factory.mktemp("nvme_two_ranks")
    run_two_ranks(Path(__file__).parent / "scripts" / "nvme_resume.py", "--phase", "run", "--with-delink-cases",
                  "--out", str(out), timeout=900)
    return out


def test_the_nvme_delink_on_two_ranks(two_ranks):
    """Each rank swaps its own partitions in its own files; the runs by sub-group are the same on both, so the
    gathers' collectives pair up."""
    results = [r for rank in (0, 1) for r in json.loads((two_ranks / f"rank{rank}.json").read_text())]
    assert sorted((r["rank"], r["dtype"]) for r in results) == [(0, "bf16"), (0, "fp32"), (1, "bf16"), (1, "fp32")]
    for r in results:
        tag = f"rank {r['rank']} {r['dtype']}"
        assert r["pseudo_swapped"] == 1 and r["real_swapped"] >= 2, tag
        assert r["losses"] == r["host_losses"], tag
        assert r["moments_not_carried"] == [], tag
        passes = 2 + (r["dtype"] == "bf16")
        assert r["swaps_during_delink"] == {"in": 1 + passes * r["real_swapped"],
                                            "out": passes * r["real_swapped"]}, tag


def _masters(engine) -> dict:
    return ds_state.gather_full_state(engine.engine, with_moments=False)[0]


@pytest.mark.parametrize("saved_after, device", [(1, "nvme"), (3, "nvme"), (1, "cpu"), (3, "cpu"), (3, "infinity")])
def test_a_resume_under_offload_reproduces_the_run(async_io, tmp_path, saved_after, device):
    """A checkpoint of the pseudo (after step 1) or the real stage (after step 3, past the delink), loaded by a new
    engine whose weights are other than the checkpoint's, trains on with the uninterrupted run's losses and ends with
    its fp32 masters, bit for bit. Under ``nvme`` DeepSpeed 0.19.8 alone restores from such a checkpoint only the
    swapped sub-groups' fp32 masters, and only from files named by the saving engine's parameter ids
    (benchmarks/nvme_offload.py): not their moments, and nothing of the sub-groups it keeps in memory (under 1 MiB).
    Under both, DeepSpeed's CPU Adam kernel computes its bias correction from the steps it has seen (a product over
    steps, or pow() after a jump): the real engine's kernel first steps at 3, the resumed one's at 4. ``infinity``:
    the parameters on NVMe too (``offload_param: nvme``), where the load's check has no weights in memory to compare."""
    cfg = offload_config("nvme" if device == "infinity" else device, str(tmp_path / "swap"))
    if device == "infinity":
        # buffers of 2**20 elements, not DeepSpeed's 5 x 1e8 (pinned, per engine, 2 GB in fp32): the test's engines
        # would otherwise hold some 18 GB of host memory
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "params"),
                                                     "buffer_size": 2**20}
    uninterrupted, engine, *_ = train(cfg, D_MODEL, steps=saved_after + 2)
    expected = _masters(engine)
    engine.engine.destroy()
    first, engine, *_ = train(cfg, D_MODEL, steps=saved_after)
    if device != "cpu":
        swapped, sub_groups = nvme_delink.swappable_sub_groups(engine), len(engine.engine.optimizer.fp32_partitioned_groups_flat)
        assert (swapped, sub_groups) == ((1, 1) if saved_after == 1 else (3, 4))  # real: swapped ones and one in memory
    engine.save_checkpoint(str(tmp_path / "checkpoints"))
    engine.engine.destroy()
    resumed = ds_pseudo_real.initialize(model=nvme_delink.gpt_with_idle_parameters(D_MODEL), config=cfg)[0]
    if device != "infinity":  # (there the real engine the load builds starts from the pseudo weights)
        with torch.no_grad():
            for param in resumed.module.parameters():
                param.ds_tensor.add_(1.0)  # other weights than the checkpoint's
    resumed.load_checkpoint(str(tmp_path / "checkpoints"))
    losses = []
    for step in range(saved_after, saved_after + 2):
        loss = resumed(*fixed_batch(step))
        resumed.backward(loss)
        resumed.step()
        losses.append(loss.item())
    assert first + losses == uninterrupted
    found = _masters(resumed)
    # under nvme DeepSpeed gives a parameter without a gradient moments from a reused buffer (see the first test)
    compared = [name for name in expected if device == "cpu" or not name.endswith("idle")]
    assert [name for name in compared if not torch.equal(found[name], expected[name])] == []
    resumed.engine.destroy()


def test_a_resume_under_nvme_in_new_processes_on_two_ranks(two_ranks):
    """As a job resumes: new processes, each rank its own files, fp32 and bf16, from a real-stage checkpoint; every
    rank trains on with the losses of the run that saved it."""
    run_two_ranks(Path(__file__).parent / "scripts" / "nvme_resume.py", "--phase", "resume", "--out", str(two_ranks),
                  timeout=900)
    for rank in (0, 1):
        ran, resumed = (json.loads((two_ranks / f"{phase}_rank{rank}.json").read_text()) for phase in ("run", "resume"))
        for before, after in zip(ran, resumed):
            tag = f"rank {rank} {before['dtype']}"
            assert before["stage"] == after["stage"] == "real", tag
            assert 1 <= after["swapped"] < after["sub_groups"], tag  # swapped sub-groups and one in memory
            assert after["losses"] == before["losses"][3:], tag


@pytest.mark.parametrize("saved_after", [1, 3])
def test_convert_reads_the_fp32_masters_swapped_to_nvme(async_io, tmp_path, saved_after):
    """``ds-pseudo-real convert`` of a pseudo (after step 1) or real (after step 3) checkpoint whose sub-groups were
    swapped: DeepSpeed's ZeRO files hold an empty fp32 partition for each of them (``zero_to_fp32`` stopped with
    "consumed 1321951 numels out of 41440"); the converted weights are the run's fp32 masters, bit for bit."""
    from ds_pseudo_real.checkpointing import convert

    _, engine, *_ = train(offload_config("nvme", str(tmp_path / "swap")), D_MODEL, steps=saved_after)
    expected = _masters(engine)
    engine.save_checkpoint(str(tmp_path / "checkpoints"))
    engine.engine.destroy()
    converted = convert.convert(str(tmp_path / "checkpoints"), str(tmp_path / "converted"), to_real=True)
    real = torch.load(converted / "model_fp32.pt", weights_only=True)
    layers = {name for name in real if name.startswith("layers.")}
    assert len(layers) == 4 * len({n.split(".", 2)[2] for n in layers})  # every layer's parameters, 4 layers
    source = nvme_delink.source_of if saved_after == 1 else (lambda name: name)
    assert [name for name in real if not torch.equal(real[name], expected[source(name)])] == []


@pytest.mark.parametrize("device", ["nvme", "cpu"])
def test_a_load_without_the_optimizer_state_under_offload_restores_the_weights(async_io, tmp_path, device):
    """``load_optimizer_states=False``: the weights are the checkpoint's (the next loss is the uninterrupted run's),
    the optimizer starts without state. Under ``nvme`` DeepSpeed alone restores no weights of the sub-groups it keeps
    in memory (refused by the load's check before)."""
    cfg = offload_config(device, str(tmp_path / "swap"))
    uninterrupted, engine, *_ = train(cfg, D_MODEL, steps=4)
    engine.engine.destroy()
    _, engine, *_ = train(cfg, D_MODEL, steps=3)
    engine.save_checkpoint(str(tmp_path / "checkpoints"))
    engine.engine.destroy()
    resumed = ds_pseudo_real.initialize(model=nvme_delink.gpt_with_idle_parameters(D_MODEL), config=cfg)[0]
    with torch.no_grad():
        for param in resumed.module.parameters():
            param.ds_tensor.add_(1.0)  # other weights than the checkpoint's
    resumed.load_checkpoint(str(tmp_path / "checkpoints"), load_optimizer_states=False)
    assert resumed(*fixed_batch(3)).item() == uninterrupted[3]
    assert ds_state.step_counters(resumed.engine)["state_step"] is None  # no optimizer state
    resumed.engine.destroy()
