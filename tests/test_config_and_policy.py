"""The pseudo_to_real config section and the pure transition logic (triggers, moment policies, re-warmup)."""
import pytest
import torch

from ds_pseudo_real.callbacks import TrainingControl, TrainingState
from ds_pseudo_real.config import ConfigError, SwitchTrigger, parse_pseudo_to_real
from ds_pseudo_real.transition import StageTransitionCallback, lr_factor, member_moments, plateaued, rewarmup_factor

pytestmark = pytest.mark.no_ops  # builds no DeepSpeed engine: never waits for its C++ ops


def parse(section):
    return parse_pseudo_to_real({"pseudo_to_real": section})


def test_defaults_and_absent_section():
    cfg = parse({"layers": "transformer.h", "switch": {"at_tokens": 1000}})
    assert (cfg.enabled, cfg.groups, cfg.optimizer_state, cfg.rewarmup_steps) == (True, 1, "copy", 0)
    assert cfg.switch.at_tokens == 1000
    assert parse_pseudo_to_real({}).enabled is False


@pytest.mark.parametrize(
    "section, expected",
    [
        ({"grups": 2}, r"pseudo_to_real.grups: unknown key \(got 2\)"),
        ({"groups": 0}, r"pseudo_to_real.groups: Input should be greater than or equal to 1 \(got 0\)"),
        ({"optimizer_state": "keep"}, r"pseudo_to_real.optimizer_state: Input should be 'copy', 'reset' or 'scale' \(got 'keep'\)"),
        ({"switch": {"at_step": 5, "at_tokens": 9}}, r"pseudo_to_real.switch: .*exactly one of at_step, at_tokens, on_plateau"),
        ({"switch": {"on_plateau": {"metric": "loss"}}}, r"pseudo_to_real.switch.on_plateau.metric: .*'val_loss' or 'train_loss'"),
        ({"rewarmup_steps": -1}, r"pseudo_to_real.rewarmup_steps: .*greater than or equal to 0 \(got -1\)"),
        ({"pseudo_lr_scale": 0}, r"pseudo_to_real.pseudo_lr_scale: .*greater than 0 \(got 0\)"),
    ],
)
def test_bad_values_name_key_value_and_accepted(section, expected):
    with pytest.raises(ConfigError, match=expected):
        parse(section)


@pytest.mark.parametrize(
    "section, expected",
    [
        ({"switch": {"at_step": True}}, r"pseudo_to_real.switch.at_step: Input should be a valid integer \(got True\)"),
        ({"groups": 2.0}, r"pseudo_to_real.groups: Input should be a valid integer \(got 2.0\)"),
        ({"enabled": "yes"}, r"pseudo_to_real.enabled: Input should be a valid boolean \(got 'yes'\)"),
        ({"swich": {"at_step": 3}}, r"pseudo_to_real.swich: unknown key \(got \{'at_step': 3\}\); did you mean "
                                    r"'pseudo_to_real.switch'\?"),
        ({"switch": {"at_stpe": 5}}, r"pseudo_to_real.switch.at_stpe: unknown key \(got 5\); did you mean "
                                     r"'pseudo_to_real.switch.at_step'\?"),
        ({"switch": {"on_plateau": {"windw": 3}}}, r"did you mean 'pseudo_to_real.switch.on_plateau.window'\?"),
        ({"schedule": [{"groups": 1}, {"at_step": 3, "grups": 2}]}, r"pseudo_to_real.schedule.1.grups: unknown key "
                                                                     r"\(got 2\); did you mean 'pseudo_to_real.schedule.1.groups'\?"),
        ({"switch": {"xyzzy": 1}}, r"pseudo_to_real.switch.xyzzy: unknown key \(got 1\); accepted keys: "
                                   r"\['at_step', 'at_tokens', 'on_plateau'\]"),
    ],
    ids=["bool-for-step", "float-for-int", "string-for-bool", "section-key", "nested-key", "two-deep", "in-a-list",
         "nothing-close"],
)
def test_values_are_strict_and_unknown_keys_get_the_closest_one_dotted(section, expected):
    with pytest.raises(ConfigError, match=expected):
        parse(section)


def test_every_section_is_strict_and_suggests_dotted_keys():
    from ds_pseudo_real.run_config import RunConfig

    for config, expected in [
        ({"checkpoint": {"async_save": "yes"}}, r"checkpoint.async_save: Input should be a valid boolean \(got 'yes'\)"),
        ({"gpt": {"n_layers": 3}}, r"gpt.n_layers: unknown key \(got 3\); did you mean 'gpt.n_layer'\?"),
        ({"data": {"max_byte": 3}}, r"data.max_byte: unknown key for type 'byte_corpus'.*did you mean 'data.max_bytes'"),
        ({"granular_offload": {"device_memory": "1GB", "activations": {"micro_batch": 1, "seq_len": 8, "hidden": 8,
                                                                        "heads": 1, "checkpointing": 1}}},
         r"granular_offload.activations.checkpointing: Input should be a valid boolean \(got 1\)"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            RunConfig.load(config, world_size=1)
    assert RunConfig.load({"granular_offload": {"device_memory": "1GB", "max_level": "host_optimizer"}},
                          world_size=1).granular_offload.max_level == "host_optimizer"  # an enum by its name


def test_section_must_be_an_object():
    with pytest.raises(ConfigError, match=r"pseudo_to_real: expected an object, got 3"):
        parse_pseudo_to_real({"pseudo_to_real": 3})


def test_plateau_compares_consecutive_windows():
    assert not plateaued([3.0, 2.5, 2.0], 2, 0.1)  # not enough values yet
    assert not plateaued([3.0, 2.8, 2.5, 2.3], 2, 0.1)  # improved by 0.5
    assert plateaued([2.0, 2.0, 1.99, 1.98], 2, 0.1)  # improved by 0.015


def fire(callback, state, steps):
    control = TrainingControl()
    fired = None
    for step in steps:
        state.global_step = step
        state.tokens_seen = step * 100
        callback.on_step_end(state, control)
        if control.should_delink:
            fired = step
            break
    return fired


def test_trigger_at_step_and_at_tokens():
    assert fire(StageTransitionCallback(SwitchTrigger(at_step=7)), TrainingState(), range(1, 20)) == 7
    assert fire(StageTransitionCallback(SwitchTrigger(at_tokens=1250)), TrainingState(), range(1, 20)) == 13
    assert fire(StageTransitionCallback(SwitchTrigger(at_step=7)), TrainingState(stage="real"), range(1, 20)) is None


def test_trigger_on_validation_plateau_and_state_round_trip():
    callback = StageTransitionCallback(SwitchTrigger(on_plateau={"window": 2, "min_improvement": 0.05}))
    state, control = TrainingState(), TrainingControl()
    for value in [3.0, 2.5, 2.2, 2.1]:
        callback.on_evaluate(state, control, {"val_loss": value})
        assert not control.should_delink
    restored = StageTransitionCallback(callback.trigger)
    restored.load_state_dict(callback.state_dict())
    for value in [2.09, 2.08]:  # last two vs the two before: 2.35 -> 2.095, then 2.15 -> 2.085
        restored.on_evaluate(state, control, {"val_loss": value})
        assert not control.should_delink
    restored.on_evaluate(state, control, {"val_loss": 2.075})  # 2.095 -> 2.0775: improved by 0.0175 < 0.05
    assert control.should_delink


def test_trigger_on_training_loss_plateau_respects_min_steps():
    callback = StageTransitionCallback(SwitchTrigger(on_plateau={"metric": "train_loss", "window": 2, "min_improvement": 1.0, "min_steps": 6}))
    state, control, fired = TrainingState(), TrainingControl(), None
    for step in range(1, 10):
        state.global_step, state.last_train_loss = step, 3.0 - 0.01 * step
        callback.on_step_end(state, control)
        if control.should_delink:
            fired = step
            break
    assert fired == 6


def test_moment_policies():
    moments = {"exp_avg": torch.tensor([4.0, -8.0]), "exp_avg_sq": torch.tensor([16.0, 32.0])}
    copied = member_moments("copy", moments, 4)
    assert torch.equal(copied["exp_avg"], moments["exp_avg"]) and copied["exp_avg"] is not moments["exp_avg"]
    scaled = member_moments("scale", moments, 4)
    assert torch.equal(scaled["exp_avg"], torch.tensor([1.0, -2.0]))
    assert torch.equal(scaled["exp_avg_sq"], torch.tensor([1.0, 2.0]))
    assert member_moments("reset", moments, 4) is None
    assert torch.equal(member_moments("scale", moments, 1)["exp_avg"], moments["exp_avg"])


def test_the_lr_factor_is_the_pseudo_scale_in_a_shared_stage_times_the_rewarmup():
    assert lr_factor(True, 0.5, None, 4) == 0.5  # before any transition: no re-warmup
    assert lr_factor(True, 0.5, 1, 4) == pytest.approx(0.5 * 0.4)  # a middle stage of a schedule, ramping up
    assert [lr_factor(False, 0.5, k, 2) for k in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert lr_factor(False, 0.5, None, 0) == 1.0  # the real model from the start (enabled: false)


def test_rewarmup_factor_ramps_linearly_then_stays_at_one():
    assert [rewarmup_factor(k, 4) for k in range(6)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    assert rewarmup_factor(0, 0) == 1.0


def test_a_run_config_read_for_other_ranks_takes_the_data_parallel_size_of_the_run():
    """initialize takes a RunConfig already read: the batch split and granular offload's plan follow the ranks of
    the run it is given to (an mpu's or a PipelineModule's data-parallel group), its sections are not read again."""
    from ds_pseudo_real.run_config import RunConfig

    class TwoDataParallelRanks:
        def get_data_parallel_world_size(self):
            return 2

    config = RunConfig.load({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, world_size=1)
    assert (config.training.data_parallel_size, config.training.gradient_accumulation_steps) == (1, 8)
    on_four = RunConfig.load(config, world_size=4)
    assert (on_four.training.data_parallel_size, on_four.training.gradient_accumulation_steps) == (4, 2)
    assert on_four.pseudo_to_real is config.pseudo_to_real and RunConfig.load(on_four, world_size=4) is on_four
    assert RunConfig.load(config, mpu=TwoDataParallelRanks()).training.gradient_accumulation_steps == 4
