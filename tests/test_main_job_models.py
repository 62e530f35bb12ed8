"""The main job trains what the config names: the M6 expert-prototyping MoE from the ``m6`` section (1 rank, and 2
ranks with EP=2), a Hugging Face causal LM from a local config, with DeepSpeed's monitors; unknown sections and bad
values stop it before any model is built, with one message."""
import dataclasses
import json

import pytest
import torch

import ds_pseudo_real
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.moe.architecture import M6_TINY, embedding_parameters, layer_parameters
from ds_pseudo_real.report import read_records
from ds_pseudo_real.run_config import RunConfig
from conftest import REPO, python_path, run_main_job as run_job, run_two_ranks

RUN = ["--eval-interval", "4", "--eval-batches", "2", "--log-interval", "4", "--corpus-bytes", str(1 << 20)]


def m6_config(tmp_path, steps=8, switch=4, **sections):
    cfg = json.loads((REPO / "configs" / "m6_tiny.json").read_text())
    del cfg["granular_offload"]
    cfg["scheduler"] = {"type": "WarmupDecayLR",
                        "params": {"warmup_num_steps": 2, "warmup_max_lr": 3e-3, "total_num_steps": steps}}
    cfg["pseudo_to_real"]["switch"] = {"at_step": switch}
    cfg.update(sections)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(cfg))
    return path


def m6_parameters(layers_held, ep=1):
    arch = dataclasses.replace(M6_TINY, vocab_size=256)  # the byte corpus's vocabulary
    return embedding_parameters(arch) + layers_held * layer_parameters(arch, ep)


def test_m6_section_trains_the_moe_with_a_delink_and_deepspeeds_monitors(tmp_path):
    monitors = {"csv_monitor": {"enabled": True, "job_name": "m6"}, "tensorboard": {"enabled": True, "job_name": "m6"}}
    out = tmp_path / "run"
    log = run_job("--deepspeed_config", str(m6_config(tmp_path, **monitors)), "--output-dir", str(out), *RUN).stdout
    assert "model: m6 model, 4 layers, sequence 32, vocabulary 256, preset m6-tiny, expert_parallel 1" in log
    delink = [r for r in read_records(out / "metrics.jsonl") if r.get("event") == "delink"]
    assert len(delink) == 1 and delink[0]["step"] == 4
    assert (delink[0]["parameters_before"], delink[0]["parameters_after"]) == (m6_parameters(1), m6_parameters(4))
    val = {r["step"]: r["val_loss"] for r in read_records(out / "metrics.jsonl") if "val_loss" in r}
    assert sorted(val) == [4, 8] and val[8] < val[4] < 5.5  # below a uniform guess over 256 bytes (5.55)
    csv = out / "csv_monitor" / "m6"
    rows = (csv / "Train_Samples_val_loss.csv").read_text().splitlines()
    assert rows[0] == "step,val_loss" and [float(r.split(",")[1]) for r in rows[1:]] == [val[4], val[8]]
    assert (csv / "Train_Samples_delink.csv").read_text().splitlines()[1:] == [f"16,{float(m6_parameters(4))}"]
    stages = [r.split(",")[1] for r in (csv / "Train_Samples_stage.csv").read_text().splitlines()[1:]]
    assert stages == ["0.0"] * 4 + ["1.0"] * 4
    assert len((csv / "Train_Samples_train_loss.csv").read_text().splitlines()) == 9
    assert (csv / "Train_Samples_lr.csv").is_file()  # DeepSpeed's own event
    assert list((out / "tensorboard" / "m6").glob("events.out.tfevents.*"))


def test_m6_on_two_ranks_spreads_the_experts(tmp_path):
    out = tmp_path / "run2"
    proc = run_two_ranks(REPO / "launch" / "train.py", "--deepspeed_config", str(m6_config(tmp_path)),
                         "--output-dir", str(out), *RUN)
    assert "expert_parallel 2" in proc.stdout
    assert "rank 0 finished at step 8 stage real" in proc.stdout and "rank 1 finished at step 8 stage real" in proc.stdout
    delink = [r for r in read_records(out / "metrics.jsonl") if r.get("event") == "delink"][0]
    # Each rank holds half of every layer's experts; the model has them all.
    assert (delink["parameters_before"], delink["parameters_after"]) == (m6_parameters(1, 2), m6_parameters(4, 2))
    assert (delink["parameters_before_total"], delink["parameters_after_total"]) == (m6_parameters(1), m6_parameters(4))
    assert (f"parameters per rank {m6_parameters(1, 2):,} -> {m6_parameters(4, 2):,}, in total {m6_parameters(1):,} -> "
            f"{m6_parameters(4):,}; ") in proc.stdout
    assert f"stage pseudo, {m6_parameters(1, 2):,} parameters per rank, {m6_parameters(1):,} in total" in proc.stdout


def test_hugging_face_gpt2_from_a_local_config(tmp_path):
    pytest.importorskip("transformers", reason="the hf model section needs transformers (the project's [hf] extra)")
    cfg = json.loads(m6_config(tmp_path).read_text())
    del cfg["m6"], cfg["pseudo_to_real"]["layers"]  # found from the model type
    cfg["hf"] = {"config": {"model_type": "gpt2", "n_layer": 4, "n_embd": 32, "n_head": 2, "vocab_size": 256,
                            "n_positions": 64}}
    path = tmp_path / "hf.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "hf"
    proc = run_job("--deepspeed_config", str(path), "--output-dir", str(out), "--seq-len", "32", *RUN)
    log = proc.stdout
    assert "model: hf model, 4 layers, sequence 32, vocabulary 256, model_type gpt2" in log
    # GPT-2's default bos/eos (50256) are not left in a 256-token vocabulary: the byte corpus has no such token
    assert "token_id must be" not in proc.stdout + proc.stderr
    delink = [r for r in read_records(out / "metrics.jsonl") if r.get("event") == "delink"][0]
    import transformers

    real = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=256,
                                                                n_positions=64))
    block = sum(p.numel() for p in real.transformer.h[0].parameters())
    assert delink["parameters_after"] == sum(p.numel() for p in real.parameters())
    assert delink["parameters_after"] - delink["parameters_before"] == 3 * block


def test_a_presets_vocabulary_replaced_by_the_datas_is_said_with_both_numbers():
    from ds_pseudo_real.models.build import model_spec

    replaced = model_spec(RunConfig.load({"m6": {"preset": "m6-tiny"}}, world_size=1), {}, vocab_size=257)
    assert replaced.vocab_size == 257
    assert "vocabulary 257 (the data's tokenizer's, in place of the preset m6-tiny's 128)" in replaced.describe()
    for section, data_vocab in (({"preset": "m6-tiny", "vocab_size": 300}, 257), ({"preset": "m6-tiny"}, 128)):
        spec = model_spec(RunConfig.load({"m6": section}, world_size=1), {}, vocab_size=data_vocab)
        assert f"vocabulary {spec.vocab_size}, preset" in spec.describe()


def test_an_hf_config_dict_takes_its_special_tokens_from_the_data():
    pytest.importorskip("transformers", reason="the hf model section needs transformers")
    from ds_pseudo_real.models.build import model_spec

    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 257}
    config = model_spec(RunConfig.load({"hf": {"config": gpt2}}, world_size=1), {}, vocab_size=257,
                        eod=256).options["hf_config"]
    assert (config.bos_token_id, config.eos_token_id) == (256, 256)  # the end-of-document token, as GPT-2's
    given = model_spec(RunConfig.load({"hf": {"config": {**gpt2, "eos_token_id": 3}}}, world_size=1), {},
                       vocab_size=257, eod=256)
    assert (given.options["hf_config"].bos_token_id, given.options["hf_config"].eos_token_id) == (256, 3)


def test_hf_config_folder_that_is_not_there_is_named_and_never_looked_up_on_the_hub(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="the hf model section needs transformers")
    from ds_pseudo_real.models.build import model_spec

    folder = tmp_path / "gpt2-small"
    transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=300).save_pretrained(folder)
    spec = model_spec(RunConfig.load({"hf": {"config": str(folder)}}, world_size=1), {}, vocab_size=256)
    assert (spec.num_layers, spec.vocab_size) == (3, 300)

    def no_lookup(*args, **kwargs):
        raise AssertionError(f"transformers asked for {args}")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_lookup)
    monkeypatch.chdir(tmp_path)
    for given in ("models/gpt2-small", str(tmp_path / "missing")):
        with pytest.raises(ConfigError) as error:
            model_spec(RunConfig.load({"hf": {"config": given}}, world_size=1), {}, vocab_size=256)
        assert str(error.value).startswith(f"hf.config: no such folder {given} ({tmp_path / given}: a relative path "
                                           f"is read from the working directory)")


@pytest.mark.parametrize("change, message", [
    ({"pseudo_to_reel": {"switch": {"at_step": 2}}},
     "pseudo_to_reel: unknown top-level key, known to neither DeepSpeed nor ds_pseudo_real; did you mean 'pseudo_to_real'?"),
    ({"m6x": {}}, "m6x: unknown top-level key, known to neither DeepSpeed nor ds_pseudo_real; did you mean 'm6'?"),
    ({"m6": {"preset": "m6-100t"}}, "m6.preset: Input should be 'm6-10t', 'm6-1t-like' or 'm6-tiny' (got 'm6-100t')"),
    ({"m6": {"preset": "m6-tiny", "expert_parallel": 3}}, "m6.expert_parallel: got 3; it must divide both the 8 experts"),
    ({"pseudo_to_real": {"groups": 3}}, "pseudo_to_real.groups: got 3; it must be >= 1 and divide the number of layers (4)"),
    ({"gpt": {"n_layer": 2}}, "the config has the model sections ['gpt', 'm6']"),
], ids=["misspelled-section", "m6x", "preset", "expert-parallel", "groups", "two-models"])
def test_config_errors_stop_before_the_model_with_one_message(tmp_path, change, message):
    out = tmp_path / "bad"
    proc = run_job("--deepspeed_config", str(m6_config(tmp_path, **change)), "--output-dir", str(out), *RUN, expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in proc.stderr and "Traceback" not in proc.stderr
    assert "model:" not in proc.stdout and not out.exists()  # nothing built, nothing written


def test_check_validates_the_config_on_the_given_ranks_without_starting_one(tmp_path):
    """``--check CONFIG`` runs the job's own validation for ``--world-size`` ranks and builds nothing: one ``error:``
    line and exit 2 for what would stop the job (DeepSpeed's own sections and batch arithmetic included), one ``ok:``
    line and exit 0 otherwise."""
    def config(name, **sections):
        (tmp_path / name).mkdir()
        return m6_config(tmp_path / name, **sections)

    spread = config("spread", m6={"preset": "m6-tiny", "expert_parallel": 2})
    lines = run_job("--check", str(spread), "--world-size", "2", "--seq-len", "16").stdout.splitlines()
    ok = [line for line in lines if not line.startswith("[20")]  # DeepSpeed's logger says which accelerator
    assert len(ok) == 1 and ok[0].startswith(f"ok: {spread} on 2 ranks: m6 model, 4 layers, sequence 16, "), ok
    assert "expert_parallel 2" in ok[0] and "600 steps" not in ok[0] and "8 steps of 4 x 1 x 2 sequences" in ok[0]
    assert "vocabulary 256 (the data's tokenizer's, in place of the preset m6-tiny's 128)" in ok[0]
    cases = [
        (spread, "3", "error: m6.expert_parallel: got 2; it must divide both the 8 experts and the 3 ranks"),
        (config("zero", zero_optimization={"stage": 1, "reduce_bucket": 5}), "1",
         "error: invalid config: DeepSpeed's DeepSpeedZeroConfig refuses\n  reduce_bucket: Extra inputs are not "
         "permitted (got 5)"),
        (config("batch", train_batch_size=32), "3", "train_batch_size: got 32, but train_micro_batch_size_per_gpu 4"
         " x gradient_accumulation_steps 1 x data-parallel size 3 = 12"),
    ]
    for config, world, message in cases:
        proc = run_job("--check", str(config), "--world-size", world, expect=2)
        assert len([line for line in proc.stderr.splitlines() if line.startswith("error:")]) == 1, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr and "ok:" not in proc.stdout


def test_config_error_under_torchrun_names_its_cause_in_torchruns_summary(tmp_path):
    """torchrun turns a rank's exit status 2 into its own ChildFailedError (exit 1); the entry point is recorded
    (torch elastic's ``@record``), so the summary's root cause is the error, not an empty one."""
    import os
    import subprocess
    import sys

    from conftest import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=python_path(), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(REPO / "launch" / "train.py"), "--deepspeed_config",
                           str(m6_config(tmp_path, pseudo_to_reel={})), "--output-dir", str(tmp_path / "run")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == ["error: invalid config:"]
    root_cause = proc.stderr[proc.stderr.index("Root Cause (first observed failure):"):]
    assert "exitcode  : 2" in root_cause and "To enable traceback see" not in root_cause
    assert "ConfigError: invalid config:" in root_cause and "pseudo_to_reel: unknown top-level key" in root_cause


def test_without_the_section_the_job_says_pseudo_to_real_is_off(tmp_path):
    cfg = json.loads(m6_config(tmp_path).read_text())
    del cfg["pseudo_to_real"]
    path = tmp_path / "off.json"
    path.write_text(json.dumps(cfg))
    log = run_job("--deepspeed_config", str(path), "--output-dir", str(tmp_path / "off"), "--steps", "2", *RUN).stdout
    assert "no 'pseudo_to_real' section in the config: Pseudo-to-Real is off, the real model trains from step 0" in log
    assert "rank 0 finished at step 2 stage real" in log


def test_initialize_refuses_unknown_sections_and_takes_model_outputs_with_a_loss():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="zero_optimisation: unknown top-level key.*did you mean 'zero_optimization'"):
        ds_pseudo_real.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimisation": {}})

    class WithOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return type("Output", (), {"loss": x.pow(2).mean(), "logits": x})()

    torch.manual_seed(0)
    engine, *_ = ds_pseudo_real.initialize(model=WithOutput(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "pseudo_to_real": {"switch": {"at_step": 1}}})
    x = torch.randn(2, 4)
    first = engine(x)
    engine.backward(first)  # the output object, not its loss
    engine.step()
    assert engine.stage == "real" and engine(x).loss.item() < first.loss.item()
    engine.engine.destroy()


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.json")))
def test_shipped_configs_are_accepted_by_the_main_job(name):
    from ds_pseudo_real.models.build import model_spec

    cfg = json.loads((REPO / "configs" / name).read_text())
    world = cfg.get("m6", {}).get("expert_parallel", 2)  # the rank count the config is written for
    spec = model_spec(RunConfig.load(cfg, world_size=world), {}, vocab_size=256)
    if "m6" in cfg:
        assert spec.kind == "m6" and spec.options["preset"] == cfg["m6"]["preset"]
        assert spec.options["expert_parallel"] == world


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.json")
                                        if "granular_offload" in json.loads(p.read_text())))
def test_shipped_configs_plan_the_model_the_main_job_trains(name):
    """What ``ds-pseudo-real plan`` plans for a shipped config (its ``granular_offload.model``, or its m6 section's
    architecture) is the model the main job builds from that config on the ranks it is written for, data included
    (built here on the meta device): the same layers, parameters per layer, experts per layer and other parameters
    per rank. For the configs this CPU machine runs, the job's plans for that model fit the config's budget in every
    stage (the pseudo model's at start, the real model's at the delink); the large ones' plans are the plan
    command's (tests/offload/test_config_cli.py)."""
    from ds_pseudo_real.models.build import build_model
    from ds_pseudo_real.offload import model_groups
    from ds_pseudo_real.plan_command import m6_model_size
    from ds_pseudo_real.offload.config import training_setup
    from ds_pseudo_real.offload.planner import PlacementLevel, plan_placement
    from ds_pseudo_real.sharing import apply_sharing
    from launch.job import read_job
    from launch.train import parse_args

    cfg = json.loads((REPO / "configs" / name).read_text())
    world = cfg.get("m6", {}).get("expert_parallel", 1)
    # the model's shape only: the large ones train on the demo corpus only with --allow-demo-corpus
    job = read_job(parse_args(["--check", str(REPO / "configs" / name), "--world-size", str(world),
                               "--allow-demo-corpus"]), world)
    with torch.device("meta"):
        model = build_model(job.spec)
    sizes, _ = model_groups(model, job.spec.layers, world)
    dense = [s.numel for s in sizes if s.name.startswith("layer") and not s.is_experts]
    experts = [s.numel for s in sizes if s.is_experts] or [0]
    built = (len(dense), set(dense), set(experts), sum(s.numel for s in sizes if s.name == "other"))
    section = job.config.granular_offload
    planned = m6_model_size(job.config.model, section.model) if "m6" in cfg else section.model
    assert built == (planned.num_layers, {planned.layer_params}, {planned.expert_params}, planned.other_params)

    if "tiny" not in name:
        return
    setup = training_setup(section, job.config.training, job.spec.num_layers, "cpu")
    layers, ptr = job.spec.num_layers, job.config.pseudo_to_real
    stages = [groups for _, groups in ptr.stages(layers)] if ptr.enabled else [layers]
    for groups in reversed(stages):  # the real model first, then it is shared into the pseudo model
        apply_sharing(model, job.spec.layers, groups)
        plan = plan_placement(model_groups(model, job.spec.layers, world)[0], setup, section.device_memory,
                              PlacementLevel(section.max_level))
        assert plan.fits()
