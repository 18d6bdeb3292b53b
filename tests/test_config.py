import pytest

from agentrl.config import Config, load_config
from agentrl.errors import UserError


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_are_the_paper_defaults():
    cfg = load_config()
    assert cfg.env.max_steps == 30 and cfg.sampling.temperature == 0.7 and cfg.model.name == "default"


def test_yaml_then_overrides(tmp_path):
    p = write(tmp_path, "seed: 7\nsampling:\n  temperature: 1\n  max_new_tokens: 32\neval:\n  split: valid_unseen\n")
    cfg = load_config(p, {"sampling.max_new_tokens": 16, "eval.limit": None})
    assert cfg.seed == 7
    assert cfg.sampling.temperature == 1.0 and isinstance(cfg.sampling.temperature, float)
    assert cfg.sampling.max_new_tokens == 16  # CLI beats YAML
    assert cfg.eval.split == "valid_unseen" and cfg.eval.limit is None


def test_unknown_key_suggests_the_right_one(tmp_path):
    with pytest.raises(UserError, match=r"unknown config key 'sampling.temperatur'.*did you mean.*'temperature'"):
        load_config(write(tmp_path, "sampling:\n  temperatur: 0.5\n"))


def test_malformed_yaml_is_one_clear_line(tmp_path):
    with pytest.raises(UserError, match=r"malformed YAML .* \(line \d+\)") as e:
        load_config(write(tmp_path, "env:\n  max_steps: [1, 2\n"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("env:\n  max_steps: 0\n", "env.max_steps must be >= 1"),
        ("env:\n  max_steps: many\n", "env.max_steps must be int"),
        ("sampling:\n  top_p: 1.5\n", "sampling.top_p"),
        ("eval:\n  split: test\n", "unknown split 'test'"),
        ("eval:\n  task_types: [pick_and_place]\n", "did you mean 'pick_and_place_simple'"),
        ("env: 3\n", "must be a mapping"),
    ],
)
def test_bad_values_are_refused(tmp_path, text, message):
    with pytest.raises(UserError, match=message):
        load_config(write(tmp_path, text))


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_shipped_configs_load():
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert configs, "configs/ is empty"
    for p in configs:
        assert isinstance(load_config(p), Config)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rollout.gate": "10"}, "malformed gate '10'"),
        ({"rollout.gate": "0,0.1"}, "K must be >= 1"),
        ({"rollout.gate": "10,1.2"}, r"d_L must be in \[0, 1\]"),
        ({"rollout.gate": "40,0.1"}, "beyond T_max=30"),
        ({"rollout.group_size": 1}, "group_size must be >= 2"),
        ({"rollout.gate": "off", "rollout.gate_or_tau": 0.9}, "needs a gate"),
    ],
)
def test_bad_rollout_settings(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_gate_default_is_the_paper_operating_point():
    from agentrl.rollout.gate import Gate

    assert load_config().rollout.parsed_gate() == Gate(10, 0.12)
    assert load_config(None, {"rollout.gate": "off"}).rollout.parsed_gate() is None
