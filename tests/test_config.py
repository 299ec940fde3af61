"""Config loading: YAML + `base:` includes + dotted overrides, errors that name the key, one source of truth."""

import glob
import os
import shutil
import subprocess
import sys

import msgspec
import pytest
import yaml

from areal_async.config import (
    ConfigError,
    MultiTurnConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    from_dict,
    load_config,
    to_dict,
)
from areal_async.config.help import describe, iter_fields

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(None, ["eta=2", "mode=sync", "train.optim.lr=3e-4", "server.urls=[http://a, http://b]"])
    assert isinstance(cfg, RunConfig)
    assert cfg.schedule.eta == 2 and cfg.schedule.mode == "sync" and cfg.schedule.effective_eta == 0
    assert cfg.train.optim.lr == 3e-4
    assert cfg.server.urls == ["http://a", "http://b"]
    assert load_config(None, ["steps=7"]).schedule.total_steps == 7
    assert load_config(None, ["total_steps=8"]).schedule.total_steps == 8


def test_yaml_file_and_null(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("schedule:\n  eta: 3\n  batch_size: 8\ntrain:\n  loss:\n    eps_clip: 0.1\n")
    cfg = load_config(str(p), ["schedule.eta=null"])
    assert cfg.schedule.eta is None and cfg.schedule.batch_size == 8 and cfg.train.loss.eps_clip == 0.1


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.optim.lrr=1", "train.optim.lrr"),
        ("nonsense=1", "nonsense"),
        ("train.optim.lr=abc", "train.optim.lr"),
        ("schedule.batch_size=0", "schedule.batch_size"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("schedule.mode=fast", "schedule.mode"),
        ("train.loss.dual_clip=0.5", "train.loss.dual_clip"),
        ("server.backend=external", "server.urls"),
        ("eta=-1", "schedule.eta"),
        ("rollout.multi_turn.max_turnz=3", "rollout.multi_turn.max_turnz"),
        ("rollout.multi_turn.max_turns=0", "rollout.multi_turn.max_turns"),
        ("rollout.multi_turn.feedback=Wrong {answer}", "rollout.multi_turn.feedback"),
        ("train.connect_timeout_s=0", "train.connect_timeout_s"),
        ("schedule.max_wall_s=-1", "schedule.max_wall_s"),
        ("train.advantage.overlong_cache_len=-1", "train.advantage.overlong_cache_len"),
    ],
)
def test_errors_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(key), str(e.value)


def test_short_override_name_in_a_file_names_the_key(tmp_path):
    p = tmp_path / "short.yaml"
    p.write_text("total_steps: 5\n")  # `total_steps=5` works as an override only
    with pytest.raises(ConfigError, match="^total_steps: unknown key; did you mean schedule.total_steps\\?$"):
        load_config(str(p))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["eta"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("schedule: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_shipped_configs_load():
    paths = glob.glob(os.path.join(CONFIGS, "*.yaml"))
    assert len(paths) >= 3
    for path in paths:
        load_config(path)


def test_default_yaml_equals_the_code_defaults():
    """An installed copy has no configs/: the code defaults must be what configs/default.yaml says."""
    assert load_config(os.path.join(CONFIGS, "default.yaml")) == RunConfig()
    # the values issue 13 found disagreeing
    d = RunConfig()
    assert d.schedule.eta == 1 and d.train.optim.lr == 1e-4 and d.train.micro_batch_tokens == 2048


def test_base_includes(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.yaml").write_text("seed: 3\nschedule:\n  eta: 2\n  batch_size: 4\nserver:\n  extra_args: [x, y]\n")
    (tmp_path / "sub" / "b.yaml").write_text("base: ../a.yaml\nschedule:\n  batch_size: 8\n")
    (tmp_path / "c.yaml").write_text("base: sub/b.yaml\nserver:\n  extra_args: [z]\n")
    cfg = load_config(str(tmp_path / "c.yaml"), ["seed=5"])
    assert cfg.seed == 5  # override > file > base
    assert cfg.schedule.eta == 2 and cfg.schedule.batch_size == 8  # mappings merge, the later file wins
    assert cfg.server.extra_args == ["z"]  # lists are replaced
    (tmp_path / "loop1.yaml").write_text("base: loop2.yaml\n")
    (tmp_path / "loop2.yaml").write_text("base: loop1.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(str(tmp_path / "loop1.yaml"))
    (tmp_path / "nobase.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nobase.yaml"))


def test_multiturn_config_is_a_few_lines_over_the_default():
    with open(os.path.join(CONFIGS, "multiturn.yaml")) as f:
        lines = [ln for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(lines) <= 12, lines
    cfg = load_config(os.path.join(CONFIGS, "multiturn.yaml"))
    default = RunConfig()
    assert cfg.rollout.workflow == "multi_turn" and cfg.schedule.filter_uniform_reward
    assert isinstance(cfg.rollout.multi_turn, MultiTurnConfig) and cfg.rollout.multi_turn.max_turns == 2
    assert cfg.train == default.train and cfg.server == default.server and cfg.schedule.eta == default.schedule.eta


def test_derived_fields_have_one_source():
    cfg = load_config(None, ["steps=25", "rollout.temperature=0.7"])
    assert cfg.train.optim.total_steps == 25 and cfg.train.temperature == 0.7
    assert load_config(None, ["rollout.temperature=0"]).train.temperature == 1.0  # greedy rollouts: scored at 1
    with pytest.raises(ConfigError, match="^train.optim.total_steps: comes from schedule.total_steps"):
        load_config(None, ["steps=25", "train.optim.total_steps=1000"])
    with pytest.raises(ConfigError, match="^train.temperature: comes from rollout.temperature"):
        load_config(None, ["rollout.temperature=0.7", "train.temperature=1.0"])
    # what the run writes to config.json loads back unchanged (it carries the derived values)
    assert from_dict(to_dict(cfg)) == cfg
    # a config built in Python derives them too
    assert RunConfig(schedule=ScheduleConfig(total_steps=9)).train.optim.total_steps == 9
    # a trainer rank reads its section alone, with the value the run derived
    assert from_dict(to_dict(cfg.train), TrainConfig).temperature == 0.7


def test_schedule_section_validates_for_embedders():
    ScheduleConfig(batch_size=4, total_steps=10).validate("schedule")
    with pytest.raises(ConfigError, match="^schedule.batch_size"):
        ScheduleConfig(batch_size=0).validate("schedule")
    with pytest.raises(ConfigError, match="^schedule.interrupt_mode"):
        ScheduleConfig(interruptible=False, interrupt_mode="in_place").validate("schedule")


def test_every_field_is_documented():
    missing = [key for key, _default, doc in iter_fields() if not doc]
    assert not missing, missing
    text = describe()
    for key, _default, _doc in iter_fields():
        assert f"  {key} = " in text


def test_help_lists_keys_with_their_docs():
    p = subprocess.run([sys.executable, "-m", "areal_async.run", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for needle in (
        "schedule.interrupt_mode = abort",
        "keep their KV cache",
        "train.loss.prox_logp = recompute",
        "train.loss.kl_coef = 0.0",
        "train.advantage.estimator = grpo",
        "base:",
        "--print-config",
    ):
        assert needle in p.stdout, needle


def test_print_config_from_an_installed_copy_without_configs(tmp_path):
    """Only the package itself (no configs/ folder beside it), run from elsewhere: the defaults are the same."""
    pkg = tmp_path / "site"
    shutil.copytree(
        os.path.join(REPO, "areal_async"), pkg / "areal_async", ignore=shutil.ignore_patterns("__pycache__")
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    p = subprocess.run(
        [sys.executable, "-m", "areal_async.run", "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=work,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    assert from_dict(yaml.safe_load(p.stdout)) == load_config(os.path.join(CONFIGS, "default.yaml"))


def test_multi_turn_section_is_typed():
    cfg = load_config(None, ["rollout.multi_turn.max_turns=3", "rollout.multi_turn.truncated_reward=null"])
    assert cfg.rollout.multi_turn == MultiTurnConfig(max_turns=3, truncated_reward=None)
    assert msgspec.to_builtins(cfg)["rollout"]["multi_turn"]["max_turns"] == 3
