"""Config loading: YAML + dotted overrides, errors that name the key."""

import pytest

from areal_async.config import ConfigError, RunConfig, load_config


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(None, ["eta=2", "mode=sync", "train.optim.lr=3e-4", "server.urls=[http://a, http://b]"])
    assert isinstance(cfg, RunConfig)
    assert cfg.rollout.eta == 2 and cfg.rollout.mode == "sync" and cfg.rollout.effective_eta == 0
    assert cfg.train.optim.lr == 3e-4
    assert cfg.server.urls == ["http://a", "http://b"]


def test_yaml_file_and_null(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  eta: 3\n  batch_size: 8\ntrain:\n  loss:\n    eps_clip: 0.1\n")
    cfg = load_config(str(p), ["rollout.eta=null"])
    assert cfg.rollout.eta is None and cfg.rollout.batch_size == 8 and cfg.train.loss.eps_clip == 0.1


@pytest.mark.parametrize("override,key", [
    ("train.optim.lrr=1", "train.optim.lrr"),
    ("nonsense=1", "nonsense"),
    ("train.optim.lr=abc", "train.optim.lr"),
    ("rollout.batch_size=0", "rollout.batch_size"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.mode=fast", "rollout.mode"),
    ("train.loss.dual_clip=0.5", "train.loss.dual_clip"),
    ("server.backend=external", "server.urls"),
    ("eta=-1", "rollout.eta"),
])
def test_errors_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(key), str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["eta"])


def test_shipped_configs_load():
    import glob
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    for path in glob.glob(os.path.join(root, "*.yaml")):
        load_config(path)
