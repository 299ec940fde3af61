"""The mistakes of a first hour with the project, each caught before anything starts, and what a new user expects
of an installed package: overrides typed by their field, errors that say what to type instead, checks of the host
(GPUs, SGLang, ports) before the model loads, model.dtype reaching the servers, files readable as the umask allows,
console scripts and optional extras."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tomllib

import pytest
import yaml

from areal_async.config import ConfigError, load_config, to_dict
from areal_async.config.help import describe
from areal_async.session import prepare as run_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_WEIGHTS = os.path.join(ROOT, "areal_async", "tasks", "base_weights")


def error_of(overrides: list[str], path: str | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


# ---- overrides and their errors -----------------------------------------------------------------------------------


def test_text_fields_keep_override_text_as_typed():
    cfg = load_config(
        None,
        [
            "train.cuda_visible_devices=0",
            "server.api_key=123456",
            "slurm.account=no",
            "slurm.partition=1e-5",
            "data.name=true.jsonl",
            "server.extra_args=[--dtype, 0.80, no]",
        ],
    )
    assert cfg.train.cuda_visible_devices == "0"
    assert cfg.server.api_key == "123456"
    assert cfg.slurm.account == "no"
    assert cfg.slurm.partition == "1e-5"
    assert cfg.server.extra_args == ["--dtype", "0.80", "no"]  # each item as typed, not 0.8 and False


def test_optional_text_takes_null_and_quoted_text():
    cfg = load_config(
        None, ["server.api_key=123", "server.api_key=null", "slurm.account='null'", 'slurm.partition="0,1"']
    )
    assert cfg.server.api_key is None
    assert cfg.slurm.account == "null"
    assert cfg.slurm.partition == "0,1"


def test_other_fields_still_read_yaml():
    cfg = load_config(
        None,
        ["eta=null", "schedule.batch_size=4", "train.optim.lr=1e-5", "resume=no", "data.reward_options={budget_s: 3}"],
    )
    assert cfg.schedule.eta is None and cfg.schedule.batch_size == 4 and cfg.train.optim.lr == 1e-5
    assert cfg.resume is False and cfg.data.reward_options == {"budget_s": 3}
    assert "schedule.batch_size" in error_of(["schedule.batch_size=four"])


def test_a_number_in_a_yaml_file_for_a_text_field_says_how_to_quote(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  api_key: 123456\n")
    msg = error_of([], str(path))
    assert msg.startswith("server.api_key: ") and 'quote the value in a YAML file, e.g. "123456"' in msg


def test_help_says_how_override_values_are_read():
    text = describe()
    assert "server.api_key=123456" in text and "as typed" in text and '"null"' in text


@pytest.mark.parametrize(
    "override, key, choices",
    [
        ("mode=fast", "schedule.mode", "async, sync"),
        ("model.dtype=fp16", "model.dtype", "auto, bfloat16, float16, float32"),
        ("server.backend=tgi", "server.backend", "embedded, external, sglang, vllm"),
    ],
)
def test_enum_errors_list_the_choices(override, key, choices):
    msg = error_of([override])
    assert msg.startswith(f"{key}: ") and f"choose one of {choices}" in msg


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("server.backnd=sglang", "did you mean server.backend?"),
        ("schedule.batchsize=3", "did you mean schedule.batch_size?"),
        ("sever.port=1", "did you mean server?"),
        ("step=3", "did you mean steps?"),
        ("schedule.mod=sync", "did you mean schedule.mode?"),
        ("train.optim.weight_decy=0.1", "did you mean train.optim.weight_decay?"),
    ],
)
def test_unknown_keys_get_a_did_you_mean(override, suggestion):
    msg = error_of([override])
    assert "unknown key" in msg and suggestion in msg


def test_a_wildly_unknown_key_gets_no_suggestion():
    msg = error_of(["zzqx=1"])
    assert msg == "zzqx: unknown key"


def test_printed_config_reruns_with_steps_override(tmp_path):
    dump = tmp_path / "dump.yaml"
    dump.write_text(yaml.safe_dump(to_dict(load_config(None, [])), sort_keys=False))
    cfg = load_config(str(dump), ["steps=100", "rollout.temperature=0.5"])
    assert cfg.schedule.total_steps == 100 and cfg.train.optim.total_steps == 100
    assert cfg.train.temperature == 0.5
    # a derived key set to something of its own is still named
    assert error_of(["train.optim.total_steps=5"], str(dump)).startswith("train.optim.total_steps: comes from")
    raw = yaml.safe_load(dump.read_text())
    raw["train"]["optim"]["total_steps"] = 7
    dump.write_text(yaml.safe_dump(raw))
    assert error_of(["steps=100"], str(dump)).startswith("train.optim.total_steps: comes from")


def test_the_cli_reruns_its_own_printed_config(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run(
        [sys.executable, "-m", "areal_async.run", "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    (tmp_path / "dump.yaml").write_text(p.stdout)
    p = subprocess.run(
        [sys.executable, "-m", "areal_async.run", "--config", "dump.yaml", "--print-config", "steps=100"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout)["train"]["optim"]["total_steps"] == 100


# ---- checks before launch -----------------------------------------------------------------------------------------


@pytest.fixture
def no_gpus(monkeypatch):
    """This host as one without a visible GPU, whatever it has."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def model_loads(monkeypatch):
    """Records whether prepare went on to the model (nothing may be built, loaded or started after a failed
    check of the host)."""
    calls: list[str] = []
    real = run_plan.resolve_model

    def resolve(cfg):
        calls.append(cfg.model.path)
        return real(cfg)

    monkeypatch.setattr(run_plan, "resolve_model", resolve)
    return calls


def prepare_error(overrides: list[str], tmp_path) -> str:
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as e:
        run_plan.prepare(cfg)
    return str(e.value)


def test_cuda_server_on_a_host_without_gpu(no_gpus, model_loads, tmp_path):
    for device in ("cuda", "cuda:1"):
        msg = prepare_error([f"server.device={device}"], tmp_path)
        assert msg.startswith("server.device: ") and "without a visible GPU" in msg and "CUDA_VISIBLE_DEVICES" in msg
    assert model_loads == []


def test_cuda_trainers_on_a_host_without_gpu(no_gpus, model_loads, tmp_path):
    msg = prepare_error(["train.nproc=4", "train.device=cuda"], tmp_path)
    assert msg.startswith("train.device: ") and "train.nproc=4" in msg and "without a visible GPU" in msg
    assert model_loads == []


def test_cpu_devices_pass_the_device_check(no_gpus):
    cfg = load_config(None, ["server.device=cpu", "train.device=auto"])
    run_plan.check_devices(cfg, ())
    # a Slurm job's GPUs are its nodes': not this host's business
    run_plan.check_devices(load_config(None, ["launcher=slurm", "train.device=cuda", "server.device=cuda"]), ())


def test_sglang_backend_without_sglang(monkeypatch, model_loads, tmp_path):
    """The release is read from the engine's interpreter (server.python, else this one) without importing SGLang;
    an interpreter without it is a config error naming the key and how to build one."""
    monkeypatch.setitem(os.environ, "CUDA_VISIBLE_DEVICES", "0")  # a GPU host, so only SGLang is missing
    msg = prepare_error(["server.backend=sglang", "train.device=cpu", f"server.python={sys.executable}"], tmp_path)
    assert msg.startswith("server.python: sglang is not installed in") and "make sglang" in msg
    assert "sglang" not in sys.modules  # asked of the interpreter's metadata, never imported
    assert model_loads == []


def without_chat_template(tmp_path) -> str:
    path = str(tmp_path / "no_template")
    shutil.copytree(BASE_WEIGHTS, path)
    cfg_file = os.path.join(path, "tokenizer_config.json")
    with open(cfg_file) as f:
        tok_cfg = json.load(f)
    assert tok_cfg.pop("chat_template", None) is not None
    with open(cfg_file, "w") as f:
        json.dump(tok_cfg, f)
    return path


def test_chat_template_asked_of_a_model_without_one(tmp_path):
    msg = prepare_error([f"model.path={without_chat_template(tmp_path)}", "data.apply_chat_template=true"], tmp_path)
    assert msg.startswith("data.apply_chat_template: ") and "no chat template" in msg


def test_cli_config_errors_exit_2_before_launch(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(
        [sys.executable, "-m", "areal_async.run", f"run_dir={tmp_path / 'run'}", "server.device=cuda"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "config error: server.device: " in p.stderr
    logs = tmp_path / "run" / "logs"
    assert not logs.exists() or not os.listdir(logs)  # no server or trainer was started


def test_missing_prompt_field_names_data_prompt_key(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(5)))
    msg = prepare_error([f"data.name={data}"], tmp_path)
    assert msg.startswith("data.prompt_key: ") and "missing key 'prompt'" in msg and "'question'" in msg
    # one bad record among good ones is the record's fault: the dataset is named
    data.write_text(
        json.dumps({"question": "x", "answer": "1"})
        + "\n"
        + "".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(5))
    )
    msg = prepare_error([f"data.name={data}"], tmp_path)
    assert msg.startswith("data.name: ") and "data.prompt_key names the field" in msg


@pytest.fixture
def taken_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_server_port_in_use_before_the_model_loads(taken_port, model_loads, tmp_path):
    msg = prepare_error([f"server.port={taken_port}"], tmp_path)
    assert msg.startswith("server.port: ") and f"127.0.0.1:{taken_port} is already in use" in msg
    msg = prepare_error([f"server.port={taken_port - 1}", "server.num_servers=2"], tmp_path)
    assert msg.startswith("server.port: server 1 of server.num_servers=2") and str(taken_port) in msg
    assert model_loads == []


def test_rendezvous_port_in_use(taken_port):
    cfg = load_config(None, ["train.nnodes=2", f"train.rdzv.endpoint=127.0.0.1:{taken_port}"])
    with pytest.raises(ConfigError, match=r"^train\.rdzv\.endpoint: .* already in use"):
        run_plan.check_ports(cfg)


def test_free_and_unchecked_ports_pass(taken_port):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    run_plan.check_ports(load_config(None, [f"server.port={free}"]))
    run_plan.check_ports(load_config(None, ["server.port=0"]))
    # external servers and Slurm steps bind nothing here
    run_plan.check_ports(
        load_config(None, [f"server.port={taken_port}", "server.backend=external", "server.urls=[http://127.0.0.1:1]"])
    )
    run_plan.check_ports(load_config(None, [f"server.port={taken_port}", "launcher=slurm"]))


def test_math_reward_without_math_verify(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "math_verify" else real(name, *a, **k)
    )
    with pytest.raises(ConfigError, match=r"^data\.reward: gsm8k needs the package math-verify; .*\[math\]"):
        run_plan._check_reward("gsm8k")
    run_plan._check_reward("arith")


# ---- model.dtype reaches the servers --------------------------------------------------------------------------------


def test_model_dtype_reaches_the_embedded_server():
    from areal_async.launch.processes import embedded_server_cmd
    from areal_async.server.cli import parse_args

    cmd = embedded_server_cmd(
        "/m",
        host="127.0.0.1",
        port="0",
        device="cpu",
        max_total_tokens=64,
        max_running_requests=2,
        api_key=None,
        dtype="bfloat16",
    )
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    args = parse_args(cmd[cmd.index("--model") :])
    assert args.dtype == "bfloat16" and args.device == "cpu"


def test_model_dtype_reaches_sglang_unless_given():
    from areal_async.launch.processes import sglang_server_cmd

    cmd = sglang_server_cmd("/m", host="h", port="1", api_key=None, extra_args=[], dtype="float16")
    assert cmd[cmd.index("--dtype") + 1] == "float16"
    # never SGLang's auto (an fp32 checkpoint would be served as float16 behind the identity check's back)
    auto = sglang_server_cmd("/m", host="h", port="1", api_key=None, extra_args=[])
    assert auto[auto.index("--dtype") + 1] == "bfloat16"
    given = sglang_server_cmd("/m", host="h", port="1", api_key=None, extra_args=["--dtype=half"], dtype="float16")
    assert given.count("--dtype=half") == 1 and "--dtype" not in given


def test_the_local_launcher_passes_model_dtype_to_both_backends():
    from areal_async.launch import local

    class Recorder:
        def __init__(self):
            self.calls = []

        def start_embedded_server(self, index, model, **kw):
            self.calls.append(("embedded", kw["dtype"]))

        def start_sglang_server(self, index, model, **kw):
            self.calls.append(("sglang", kw["dtype"]))

    procs = Recorder()
    for backend in ("embedded", "sglang"):
        cfg = load_config(None, [f"server.backend={backend}", "model.dtype=bfloat16", "server.device=cpu"])
        local._start_server(procs, cfg, "/m", 0, 0)
    assert procs.calls == [("embedded", "bfloat16"), ("sglang", "bfloat16")]


# ---- files follow the umask ---------------------------------------------------------------------------------------


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def modes(root: str) -> dict[str, int]:
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def test_current_umask_reads_without_changing(umask):
    from areal_async.cache import current_umask

    assert current_umask() == umask
    assert current_umask() == umask


def test_published_weights_follow_the_umask(tiny_ckpt, tmp_path, umask):
    import torch
    import transformers

    from areal_async.train.publish import publish_hf

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    for shard_bytes in (1 << 30, 40_000):  # one model.safetensors, then several shards with an index
        res = publish_hf(
            model,
            source_dir=tiny_ckpt,
            root=str(tmp_path / str(shard_bytes)),
            version=1,
            skip={"lm_head.weight"},
            max_shard_bytes=shard_bytes,
        )
        found = modes(res.path)
        weights = [n for n in found if n.endswith(".safetensors")]
        assert weights and all(found[n] == 0o666 & ~umask for n in weights), found
        assert stat.S_IMODE(os.stat(res.path).st_mode) == 0o777 & ~umask


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_trainer_checkpoint_follows_the_umask(tmp_path, umask):
    import torch

    from areal_async.train.checkpoint import save_checkpoint

    model = torch.nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, model, optim, trainer_state={"version": 1, "scheduler": {}}, rng_state={"cpu": b"x"})
    found = modes(path)
    assert "trainer_state.json" in found and ".metadata" in found
    assert all(m == 0o666 & ~umask for m in found.values()), found


def test_follow_umask_widens_private_files_and_keeps_exec_bits(tmp_path, umask):
    from areal_async.cache import follow_umask

    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    private, script = d / "sub" / "model.safetensors", d / "run.sh"
    private.write_bytes(b"x")
    script.write_text("#!/bin/sh\n")
    os.chmod(private, 0o600)
    os.chmod(script, 0o700)
    os.chmod(d / "sub", 0o700)
    follow_umask(str(d))
    assert modes(str(d)) == {
        "sub": 0o777 & ~umask,
        "run.sh": 0o777 & ~umask,
        os.path.join("sub", "model.safetensors"): 0o666 & ~umask,
    }


# ---- packaging ----------------------------------------------------------------------------------------------------


def pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_console_scripts_name_functions_that_return_exit_codes():
    scripts = pyproject()["project"]["scripts"]
    assert scripts == {"areal-run": "areal_async.run:main", "areal-serve": "areal_async.server.cli:main"}
    from areal_async.run import main

    assert main(["--print-config", "steps=3"]) == 0
    assert main(["no.such.key=1"]) == 2


def test_typed_package_and_optional_extras():
    meta = pyproject()
    assert os.path.isfile(os.path.join(ROOT, "areal_async", "py.typed"))
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["areal_async"]
    core = " ".join(meta["project"]["dependencies"])
    extras = meta["project"]["optional-dependencies"]
    for dist, extra in (
        ("gguf", "gguf"),
        ("accelerate", "gguf"),
        ("math-verify", "math"),
        ("pyarrow", "parquet"),
        ("tensorboard", "tensorboard"),
    ):
        assert dist not in core and any(d.startswith(dist) for d in extras[extra]), dist
    dev = " ".join(extras["dev"])
    for extra in ("gguf", "math", "parquet", "tensorboard"):  # make setup installs .[dev]: the tests need them
        assert extra in dev.split("[", 1)[1].split("]")[0].split(",")
    from areal_async.launch.sglang_server import SGLANG_NEWEST, SGLANG_OLDEST

    # the extra opens exactly the window the launcher accepts and CI runs for real (.ci/sglang_leg.sh)
    newest = (*SGLANG_NEWEST[:2], SGLANG_NEWEST[2] + 1)
    assert extras["sglang"] == [f"sglang>={'.'.join(map(str, SGLANG_OLDEST))},<{'.'.join(map(str, newest))}"]
    leg = open(os.path.join(ROOT, ".ci", "sglang_leg.sh")).read()
    assert f"RELEASES=({run_plan.SGLANG_TESTED.replace(' to ', ' ')})" in leg
