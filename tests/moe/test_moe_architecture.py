"""The M6 architecture descriptions: parameter counts of M6-10T and its pseudo model, built on the meta device."""
import pytest

from ds_pseudo_real import sharing
from ds_pseudo_real.moe import architecture as m6

pytestmark = pytest.mark.no_ops  # builds no DeepSpeed engine: never waits for its C++ ops


def test_m6_10t_expert_parameters_match_the_paper_product():
    arch = m6.M6_10T
    assert m6.expert_parameters_per_layer(arch) * arch.num_layers == 48 * 10240 * 2 * 1024 * 9984 == 10_050_223_472_640
    assert arch.num_experts // arch.num_prototypes == 128


def test_m6_10t_built_on_meta_device():
    real = m6.build_meta_model(m6.M6_10T)
    assert all(p.is_meta for p in real.parameters())
    count = sharing.parameter_count(real)
    assert count == m6.total_parameters(m6.M6_10T)
    assert count == pytest.approx(1.005e13, rel=1e-3)
    # Vocab 21128 and sequence 512 are choices; they add only 2.2e7 parameters.
    assert count - 48 * 10240 * 2 * 1024 * 9984 == 48 * (4 * 1024**2 + 4 * 1024 + 10240 * 1024) + (21128 + 512) * 1024 + 2048

    pseudo = m6.build_meta_model(m6.M6_10T, groups=1)
    pseudo_count = sharing.parameter_count(pseudo)
    assert pseudo_count == m6.total_parameters(m6.M6_10T, groups=1)
    assert pseudo_count == pytest.approx(2.09e11, rel=2e-3)
    assert count / pseudo_count == pytest.approx(48, rel=1e-3)


def test_per_layer_counts_for_the_planner():
    counts = m6.layer_parameter_counts(m6.M6_10T)
    assert len(counts) == 48 and counts[0] == m6.layer_parameters(m6.M6_10T) == 209_394_339_840
    pseudo = m6.layer_parameter_counts(m6.M6_10T, groups=4)
    assert pseudo == [counts[0] if i % 12 == 0 else 0 for i in range(48)]
    module_counts = [sum(p.numel() for p in layer.parameters()) for layer in m6.build_meta_model(m6.M6_TINY).layers]
    assert module_counts == m6.layer_parameter_counts(m6.M6_TINY)


def test_m6_1t_like_and_config_sections():
    assert m6.total_parameters(m6.M6_1T_LIKE) == pytest.approx(1.0e12, rel=0.01)
    tiny = m6.architecture_from_dict({"preset": "m6-tiny", "num_layers": 8})
    assert tiny.num_layers == 8 and tiny.num_experts == 8
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['layers'\]"):
        m6.architecture_from_dict({"preset": "m6-tiny", "layers": 8})
    with pytest.raises(ValueError, match="m6.preset: got 'm6-100t'"):
        m6.architecture_from_dict({"preset": "m6-100t"})
    with pytest.raises(ValueError, match="7 prototypes for 8 experts"):
        m6.architecture_from_dict({"preset": "m6-tiny", "num_prototypes": 7})


def test_layer_counts_feed_the_offload_planner():
    """At a budget the pseudo M6-tiny fits in, the real one has to offload some layers."""
    from ds_pseudo_real.offload import planner

    arch, setup, budget = m6.M6_TINY, planner.TrainingSetup(dtype="fp32", zero_stage=0), 6_000_000
    real = planner.layer_groups(m6.layer_parameter_counts(arch), m6.embedding_parameters(arch))
    assert sum(g.numel for g in real) == m6.total_parameters(arch)
    pseudo = [g for g in planner.layer_groups(m6.layer_parameter_counts(arch, groups=1), m6.embedding_parameters(arch),
                                              layer_uses=[arch.num_layers] + [1] * (arch.num_layers - 1)) if g.numel]
    pseudo_plan = planner.plan_placement(pseudo, setup, budget)
    real_plan = planner.plan_placement(real, setup, budget)
    assert {p.level for p in pseudo_plan.placements} == {planner.PlacementLevel.DEVICE}
    assert any(p.level is not planner.PlacementLevel.DEVICE for p in real_plan.placements)
    assert m6.layer_parameters(m6.M6_10T, expert_parallel=512) == 20 * 2 * 1024 * 9984 + 4 * 1024**2 + 4 * 1024 + 10240 * 1024


@pytest.mark.parametrize("name", ["m6_tiny", "m6_1t_like", "m6_10t"])
def test_m6_configs_agree_with_the_architecture(name):
    from pathlib import Path

    from ds_pseudo_real.run_config import RunConfig

    config = RunConfig.load(Path(__file__).resolve().parents[2] / "configs" / f"{name}.json")
    arch, expert_parallel = config.model.architecture(), config.model.expert_parallel or 1
    assert config.pseudo_to_real.enabled
    offload = config.granular_offload
    assert offload.model.num_layers == arch.num_layers
    assert offload.model.layer_params == m6.layer_parameters(arch, expert_parallel)
    assert offload.model.other_params == m6.embedding_parameters(arch)
