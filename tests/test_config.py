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
    with pytest.raises(UserError, match=r"unknown config key 'sampling.temperatur'.*did you mean 'sampling.temperature'"):
        load_config(write(tmp_path, "sampling:\n  temperatur: 0.5\n"))


def test_a_removed_key_names_its_replacement(tmp_path):
    """train.dapo_filter (superseded by select.stages) answers with one line naming the replacement;
    its inert value, which every older run's config.yaml holds, still loads (--resume reads those)."""
    for source in (write(tmp_path, "train:\n  dapo_filter: true\n"), None):
        with pytest.raises(UserError, match=r"^config key 'train.dapo_filter' was removed: use select.stages: cut,dapo "
                                            r"\(--select cut,dapo; without the gate, dapo\)$") as e:
            load_config(source, None if source else {"train.dapo_filter": True})
        assert "\n" not in str(e.value)
    cfg = load_config(write(tmp_path, "train:\n  dapo_filter: false\n  iterations: 3\n"))
    assert cfg.train.iterations == 3 and not hasattr(cfg.train, "dapo_filter") and cfg.select.stages is None


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
        ("env:\n  workers: many\n", "env.workers must be auto or a number >= 0"),
        ("env:\n  workers: -1\n", "env.workers must be auto or a number >= 0"),
        ("sampling:\n  merge_adapter: sometimes\n", "sampling.merge_adapter must be bool"),
        ("sampling:\n  prefill_buckets: maybe\n", "sampling.prefill_buckets must be auto, on or off, got 'maybe'"),
        ("sampling:\n  prefill_buckets: off\n", r'got False: YAML reads an unquoted on/off.*quote it \("off"\)'),
        ("sampling:\n  static_decode: on\n", r'sampling.static_decode must be str, got True.*\("on"\)'),
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


def test_tier_configs_hold_the_papers_defaults():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    t3 = load_config(root / "tier3.yaml")
    assert (t3.train.iterations, t3.rollout.tasks, t3.rollout.group_size, t3.env.max_steps) == (60, 10, 8, 30)
    assert (t3.learner.lora_r, t3.learner.lora_alpha, t3.learner.lr, t3.rollout.gate) == (16, 32, 5e-5, "10,0.12")
    assert set(t3.learner.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (t3.train.eval_every, t3.train.eval_tasks, t3.sampling.temperature) == (10, 50, 0.7)
    t2 = load_config(root / "tier2.yaml")
    assert (t2.learner.lora_r, t2.learner.lora_alpha, t2.learner.target_modules) == (8, 16, ["q_proj", "v_proj"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"learner.lr": -1e-4}, "learner.lr must be > 0"),
        ({"learner.loss_agg": "sum"}, "learner.loss_agg must be one of"),
        ({"learner.lora_r": -1}, "learner.lora_r must be >= 0"),
        ({"learner.lora_r": 0, "sampling.backend": "vllm"}, "learner.lora_r 0 .full fine-tuning. needs --sampler hf"),
        ({"learner.target_modules": []}, "at least one module"),
        ({"train.advantage": "ppo"}, "train.advantage must be one of"),
        ({"train.iterations": -1}, "train.iterations must be >= 0"),
        ({"train.eval_split": "test"}, "unknown split 'test'"),
        ({"env.kind": "minigrid"}, "env.kind must be 'alfworld' or 'synthetic'"),
        ({"learner.lrr": 0.1}, r"unknown config key 'learner.lrr'.*did you mean"),
        ({"prompt.history": -1}, "prompt.history must be a whole number >= 0"),
        ({"prompt.history": 1.5}, "prompt.history must be int"),
        ({"prompt.history": 2, "learner.loss_agg": "seq-mean-token-mean"}, "not with prompt.history"),
        ({"reward.invalid_action_in": "reward"}, "reward.invalid_action_in must be return or advantage"),
        ({"reward.invalid_action_in": "advantage", "train.advantage": "gigpo"}, "gigpo already gives each reply its own"),
    ],
)
def test_bad_training_settings(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_gate_default_is_the_paper_operating_point():
    from agentrl.specs import GateSpec

    assert load_config().rollout.parsed_gate() == GateSpec(10, 0.12)
    assert load_config(None, {"rollout.gate": "off"}).rollout.parsed_gate() is None


def test_env_workers_auto_is_one_per_available_core(tmp_path):
    import os

    from agentrl.env import env_workers

    assert load_config().env.workers == "auto"
    assert env_workers("auto") == len(os.sched_getaffinity(0))
    assert env_workers("auto", "synthetic") == 0  # its env work is a string comparison
    assert env_workers(load_config(write(tmp_path, "env:\n  workers: 3\n")).env.workers) == 3


def test_env_overlap_auto_is_on_for_the_vllm_sampler_only(tmp_path):
    from agentrl.env import env_overlap

    assert load_config().env.overlap == "auto"
    assert env_overlap(load_config(None, {"model.device": "cpu"})) is False  # CPU: one full batch decodes faster
    assert env_overlap(load_config(None, {"model.device": "cuda:0"})) is False  # hf on a GPU: the decode loop dominates
    assert env_overlap(load_config(None, {"sampling.backend": "vllm"})) is True
    assert env_overlap(load_config(write(tmp_path, "env:\n  overlap: true\n"), {"model.device": "cpu"})) is True
    with pytest.raises(UserError, match="env.overlap must be auto, true or false"):
        load_config(write(tmp_path, "env:\n  overlap: sometimes\n"))


def test_log_to_names_known_loggers_only():
    from agentrl.train.loggers import parse_log_to

    assert load_config(None, {"train.log_to": "tensorboard, wandb"}).train.log_to == "tensorboard, wandb"
    assert parse_log_to("tensorboard, wandb") == ["tensorboard", "wandb"] and parse_log_to(None) == []
    with pytest.raises(UserError, match="train.log_to must list tensorboard and/or wandb, got 'mlflow'"):
        load_config(None, {"train.log_to": "mlflow"})


def test_an_adapter_trained_with_a_history_window_is_run_with_it(tmp_path):
    """prompt.history left unset takes the adapter's (its agentrl.json); a setting given wins."""
    from agentrl.config import effective_prompt, write_adapter_record

    write_adapter_record(tmp_path, {"example": "none", "reply": "action", "admissible": True, "history": 2})
    cfg = load_config(None, {"model.adapter": str(tmp_path)})
    assert effective_prompt(cfg) == {"example": "none", "reply": "action", "admissible": True, "history": 2}
    assert load_config(None, {"model.adapter": str(tmp_path), "prompt.history": 0}).prompt.history == 0
    assert effective_prompt(load_config(None, {}))["history"] == 0  # no adapter: the whole episode
