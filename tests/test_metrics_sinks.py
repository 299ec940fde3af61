"""Metrics sinks (areal_async/metrics_sinks.py, docs/logging.md) and progress bars (areal_async/progress.py).

What a user relies on: a sink named by import path in `metrics.loggers` gets every record metrics.jsonl gets, in a
real run; a sink that raises neither stops the run nor costs metrics.jsonl a record; a bad name is a ConfigError
naming the key before anything starts; the wandb sink writes what it is given (read back from its offline files,
when wandb is installed); bars are drawn on terminals only and TQDM_DISABLE turns them off.
"""

from __future__ import annotations

import asyncio
import glob
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from areal_async import embed, metrics_sinks, progress
from areal_async.config import ConfigError, load_config
from areal_async.metrics import MetricsLogger, read_metrics
from areal_async.metrics_sinks import RunInfo, SinkSet, build_sinks
from areal_async.model_store import _last_lines

# a short real run of the shipped tiny model (the settings tests/test_embedding.py runs)
SMALL = [
    "model.path=tiny",
    "steps=2",
    "schedule.batch_size=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=24",
    "schedule.eval_every=1",
    "eval.num_prompts=4",
    "eval.max_new_tokens=16",
    "schedule.filter_uniform_reward=false",
    "server.device=cpu",
    "train.device=cpu",
]

SINK_MODULE = """
import json
import os

class Recorder:
    '''Writes every record it gets to sink_records.jsonl in the run directory.'''

    def __init__(self):
        self.file = None
        self.info = None

    def open(self, run):
        self.info = run
        self.file = open(os.path.join(run.run_dir, "sink_records.jsonl"), "a")
        with open(os.path.join(run.run_dir, "sink_opened.json"), "w") as f:
            json.dump({"run_dir": run.run_dir, "name": run.name, "resumed_version": run.resumed_version,
                       "steps": run.config["schedule"]["total_steps"]}, f)

    def log(self, record):
        self.file.write(json.dumps(record) + "\\n")
        self.file.flush()

    def close(self):
        self.file.close()
        with open(os.path.join(self.info.run_dir, "sink_closed"), "w"):
            pass

class Raiser:
    '''Raises on every call.'''

    def open(self, run):
        pass

    def log(self, record):
        raise RuntimeError("this sink is broken")

    def close(self):
        raise RuntimeError("and cannot close either")

class NoLog:
    pass

def make():
    return Recorder()

def make_raising():
    return Raiser()

def make_nolog():
    return NoLog()

def make_fails():
    raise ValueError("no credentials")
"""


@pytest.fixture
def sink_module(tmp_path, monkeypatch) -> str:
    """A user's sink module on sys.path (as `module:factory` names it); returns its name."""
    name = f"user_sinks_{os.getpid()}"
    folder = tmp_path / "sinkmod"
    folder.mkdir()
    (folder / f"{name}.py").write_text(textwrap.dedent(SINK_MODULE))
    monkeypatch.syspath_prepend(str(folder))
    yield name
    sys.modules.pop(name, None)


class Collect:
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.opened: RunInfo | None = None
        self.closed = 0

    def open(self, run: RunInfo) -> None:
        self.opened = run

    def log(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        self.closed += 1


class Broken:
    def log(self, record: dict) -> None:
        raise OSError("network down")


# ---- the sinks behind the metrics writer -------------------------------------------------------------------------


def test_every_record_reaches_the_sinks_and_a_raising_one_is_reported_once(tmp_path, caplog):
    good, info = Collect(), RunInfo.of(str(tmp_path), {"seed": 1})
    sinks = SinkSet([("broken", Broken()), ("good", good)]).open(info)
    logger = MetricsLogger(str(tmp_path), tensorboard=False, sinks=sinks)
    with caplog.at_level(logging.WARNING, logger="areal_async.metrics"):
        for v in range(1, 6):
            logger.log("train", v, {"reward_mean": v / 10, "hist": {"0": v}, "note": "x"})
        logger.log("eval", 5, {"accuracy": 0.5})
        logger.close()
        logger.close()  # twice is a no-op (write_outputs and the session both close it)
        sinks.close()
        sinks.close()
    assert good.opened == info and good.opened.name == os.path.basename(str(tmp_path)) and good.closed == 1
    assert good.records == read_metrics(str(tmp_path / "metrics.jsonl"))  # exactly what the file holds
    assert [r["kind"] for r in good.records] == ["train"] * 5 + ["eval"]
    raised = [r.message for r in caplog.records if "broken raised on a" in r.message]
    assert len(raised) == 1 and "network down" in raised[0]
    assert sinks.failures["broken"] == 6
    assert any("broken raised on 6 records" in r.message for r in caplog.records)


def test_a_sink_that_fails_to_open_is_dropped_and_the_others_go_on(tmp_path, caplog):
    class NoOpen(Collect):
        def open(self, run: RunInfo) -> None:
            raise PermissionError("not logged in")

    good, bad = Collect(), NoOpen()
    with caplog.at_level(logging.WARNING, logger="areal_async.metrics"):
        sinks = SinkSet([("bad", bad), ("good", good)]).open(RunInfo.of(str(tmp_path), {}))
    assert [n for n, _ in sinks.sinks] == ["good"] and "bad failed to open" in caplog.text
    sinks.log({"kind": "train", "step": 1, "time": 0.0})
    sinks.close()
    assert len(good.records) == 1 and bad.records == [] and bad.closed == 0


def test_a_reopened_writer_feeds_the_runs_sinks(tmp_path):
    """A rollback closes metrics.jsonl and opens a new writer on the run directory with the run's sinks
    (run_rollback.rewind): they get the redone records too; a writer given none feeds none."""
    good = Collect()
    sinks = SinkSet([("good", good)]).open(RunInfo.of(str(tmp_path), {}))
    first = MetricsLogger(str(tmp_path), tensorboard=False, sinks=sinks)
    first.log("train", 1, {"reward_mean": 0.1})
    first.close()
    again = MetricsLogger(str(tmp_path), tensorboard=False, sinks=first.sinks)  # as rewind() builds it
    again.log("train", 1, {"reward_mean": 0.2})
    again.close()
    sinks.close()
    assert [r["reward_mean"] for r in good.records] == [0.1, 0.2] and good.closed == 1
    assert MetricsLogger(str(tmp_path), tensorboard=False).sinks is None


def test_a_slow_sink_never_holds_up_the_writer(tmp_path):
    import threading
    import time

    release = threading.Event()

    class Slow(Collect):
        def log(self, record: dict) -> None:
            release.wait(10)
            super().log(record)

    slow = Slow()
    sinks = SinkSet([("slow", slow)]).open(RunInfo.of(str(tmp_path), {}))
    logger = MetricsLogger(str(tmp_path), tensorboard=False, sinks=sinks)
    t0 = time.monotonic()
    for v in range(50):
        logger.log("train", v, {"x": v})
    assert time.monotonic() - t0 < 2.0
    release.set()
    logger.close()
    sinks.close()
    assert len(slow.records) == 50


def test_tensorboard_is_one_of_the_sinks(tmp_path):
    pytest.importorskip("tensorboard")
    logger = MetricsLogger(str(tmp_path))
    logger.log("train", 3, {"reward_mean": 0.25, "flag": True, "note": "x"})
    logger.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train/reward_mean"]
    (event,) = acc.Scalars("train/reward_mean")
    assert event.step == 3 and event.value == pytest.approx(0.25)


# ---- naming sinks in the config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, message",
    [
        ("nope", "metrics.loggers[0]: 'nope' is neither wandb nor an import path module:factory"),
        ("'mod:'", "metrics.loggers[0]: 'mod:' is neither"),
    ],
)
def test_a_malformed_name_is_an_error_naming_the_key(entry, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"metrics.loggers=[{entry}]"])
    assert str(e.value).startswith(message)
    with pytest.raises(ConfigError, match=r"^metrics.loggers: a logger is named twice"):
        load_config(None, ["metrics.loggers=[a:b, a:b]"])
    with pytest.raises(ConfigError, match=r"^metrics.wandb.mode"):
        load_config(None, ["metrics.wandb.mode=sometimes"])


def test_what_build_sinks_refuses_names_the_key(sink_module, monkeypatch):
    cases = {
        "no_such_module_for_sinks:make": "cannot import 'no_such_module_for_sinks'",
        f"{sink_module}:missing": "has no 'missing'",
        f"{sink_module}:make_nolog": "returned NoLog, which has no log(record) method",
        f"{sink_module}:make_fails": "raised ValueError: no credentials",
        "os:sep": "is not callable",
    }
    for entry, why in cases.items():
        with pytest.raises(ConfigError) as e:
            build_sinks([f"{sink_module}:make", entry])
        assert str(e.value).startswith("metrics.loggers[1]: ") and why in str(e.value), (entry, str(e.value))
    (name, sink), *_ = build_sinks([f"{sink_module}:make"])
    assert name == f"{sink_module}:make" and type(sink).__name__ == "Recorder"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real_find_spec(n, *a))
    with pytest.raises(ConfigError, match=r"^metrics.loggers\[0\]: wandb is not installed; pip install"):
        build_sinks(["wandb"])


def test_a_sink_that_does_not_import_stops_the_run_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^metrics.loggers\[0\]: cannot import 'no_such_sink_module'"):
        embed.train([*SMALL, f"run_dir={run_dir}", "metrics.loggers=[no_such_sink_module:make]"])
    assert not run_dir.exists()  # checked before launch: no run directory, no process


# ---- a real run --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(400)
def test_a_user_sink_gets_every_record_of_a_real_run_and_a_raising_one_stops_nothing(sink_module, tmp_path, caplog):
    run_dir = tmp_path / "run"
    loggers = f"metrics.loggers=[{sink_module}:make_raising, {sink_module}:make]"
    with caplog.at_level(logging.WARNING, logger="areal_async.metrics"):
        result = embed.train([*SMALL, f"run_dir={run_dir}", loggers])
    assert result.summary["completed"] and result.steps == 2
    written = read_metrics(str(run_dir / "metrics.jsonl"))
    train = [r for r in written if r["kind"] == "train"]
    evals = [r for r in written if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2]  # nothing lost to the raising sink
    assert [r["step"] for r in evals] == [0, 1, 2]  # before, every step (eval_every=1), after
    got = read_metrics(str(run_dir / "sink_records.jsonl"))
    assert got == written  # every record, train and eval alike, as metrics.jsonl holds it
    with open(run_dir / "sink_opened.json") as f:
        opened = json.load(f)
    assert opened == {"run_dir": str(run_dir), "name": "run", "resumed_version": None, "steps": 2}
    assert (run_dir / "sink_closed").exists()
    raised = [r.message for r in caplog.records if "raised on a" in r.message]
    assert len(raised) == 1 and f"{sink_module}:make_raising" in raised[0] and "this sink is broken" in raised[0]
    assert any("make_raising failed to close" in r.message for r in caplog.records)
    assert os.path.isfile(run_dir / "progress.png") and os.path.isfile(run_dir / "summary.json")


def test_the_progress_plot_leaves_an_embedding_programs_matplotlib_alone(tmp_path):
    """progress.png is drawn on a figure of its own: a program that embeds the run (a notebook with its own
    backend) keeps its backend and its current figure, and pyplot is never imported for it."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (1, 2):
            f.write(json.dumps({"kind": "train", "wall_s": float(step), "reward_mean": 0.5 * step}) + "\n")
        f.write(json.dumps({"kind": "eval", "wall_s": 2.0, "accuracy": 0.25}) + "\n")
    script = textwrap.dedent(
        f"""
        import sys
        import matplotlib
        matplotlib.use("svg")
        from areal_async.metrics import plot_run
        out = plot_run({str(tmp_path)!r})
        with open(out, "rb") as f:
            assert f.read(8) == b"\\x89PNG\\r\\n\\x1a\\n"
        print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["svg", "False"]


# ---- wandb ------------------------------------------------------------------------------------------------------


def wandb_log_records(path: str) -> list[bytes]:
    """The records of a run's .wandb transaction log (wandb's LevelDB-style log: a 7-byte file header, then 32 KiB
    blocks of chunks with a 7-byte header each: crc32, length, type full/first/middle/last)."""
    with open(path, "rb") as f:
        data = f.read()
    out, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's trailer: padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            out.append(pending)
    return out


def read_wandb_offline(wandb_dir: str) -> tuple[list[dict], dict]:
    """(history rows, config) of the one offline run under `wandb_dir`, read from its transaction log."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    rows, config = [], {}
    for data in wandb_log_records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            )
        elif kind in ("run", "config"):
            updates = rec.run.config.update if kind == "run" else rec.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates})
    return rows, config


def test_wandb_sink_offline_writes_what_it_is_given(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_files"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "my-run"
    cfg = load_config(None, [f"run_dir={run_dir}", "metrics.loggers=[wandb]", "metrics.wandb.project=areal-test"])
    ((name, sink),) = build_sinks(cfg.metrics.loggers, cfg.metrics.wandb)
    sinks = SinkSet([(name, sink)]).open(RunInfo.of(str(run_dir), {"seed": 7, "schedule": {"total_steps": 2}}))
    assert sinks.sinks, "the wandb sink did not open"
    logger = MetricsLogger(str(run_dir), tensorboard=False, sinks=sinks)
    logger.log("eval", 0, {"accuracy": 0.25, "mean_len": 12.0})
    logger.log("train", 1, {"reward_mean": 0.5, "note": "text is left out"})
    logger.log("train", 2, {"reward_mean": 0.75})
    logger.log("train", 1, {"reward_mean": 0.6})  # a rollback redid version 1: logged all the same
    logger.close()
    sinks.close()
    wandb.teardown()  # its service process (wandb-core) lives as long as the process that used it: this one
    assert not sinks.failures
    assert os.path.isfile(run_dir / metrics_sinks.WANDB_ID_FILE)
    rows, config = read_wandb_offline(str(tmp_path / "wandb_files"))
    logged = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    assert logged == [
        {"eval/accuracy": 0.25, "eval/mean_len": 12.0, "version": 0},
        {"train/reward_mean": 0.5, "version": 1},
        {"train/reward_mean": 0.75, "version": 2},
        {"train/reward_mean": 0.6, "version": 1},
    ]
    assert config["seed"] == 7 and config["schedule"] == {"total_steps": 2}


# ---- progress bars ----------------------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_only_on_a_terminal_and_never_with_tqdm_disable(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert not progress.enabled(io.StringIO())
    assert isinstance(progress.bar(3, "x", stream=io.StringIO()), progress.NoBar)
    term = Terminal()
    assert progress.enabled(term)
    with progress.bar(3, "building", unit="step", stream=term) as shown:
        for _ in range(3):
            shown.update(1)
    assert "building" in term.getvalue() and "3/3" in term.getvalue()
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert not progress.enabled(Terminal())
    assert isinstance(progress.bar(3, "x", stream=Terminal()), progress.NoBar)


async def test_evaluate_draws_a_bar_on_a_terminal(monkeypatch):
    from areal_async.model_store import resolve_model_path
    from areal_async.rollout.evaluate import evaluate
    from areal_async.tokenizer import Tokenizer
    from areal_async.types import Sample

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    tok = Tokenizer(resolve_model_path("tiny"))

    class Gen:
        async def agenerate(self, ids, sampling, rid=None, **extra):
            await asyncio.sleep(0)
            out = tok.encode("#### 2")
            return SimpleNamespace(output_ids=out, output_versions=[3] * len(out))

    async def score(completion, answer, prompt="", meta=None):
        return (1.0 if completion.strip().endswith(answer) else 0.0), None

    samples = [Sample(id=i, prompt="1+1=", answer="2") for i in range(5)]
    out = await evaluate(Gen(), tok, samples, score, max_new_tokens=8)
    assert out["accuracy"] == 1.0 and out["num"] == 5.0
    assert "eval:" in term.getvalue() and "/5 [" in term.getvalue()  # drawn, then cleared (leave=False)


def test_a_failed_conversions_tail_keeps_a_bars_last_state():
    text = "loading\nConverting: 10%\rConverting: 50%\rConverting: 100%\r\nTraceback\nValueError: bad\n"
    assert _last_lines(text, 3) == ["Converting: 100%", "Traceback", "ValueError: bad"]


def test_a_converters_stderr_is_relayed_as_it_comes_and_kept(monkeypatch):
    from areal_async.model_store import _run_relaying_stderr

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    child = "import sys; sys.stderr.write('tensors 1/2\\rtensors 2/2\\n'); sys.stderr.flush(); print('{\"ok\": 1}')"
    code, out, err = _run_relaying_stderr([sys.executable, "-c", child], dict(os.environ))
    assert code == 0 and json.loads(out.strip().splitlines()[-1]) == {"ok": 1}
    assert err == term.getvalue() == "tensors 1/2\rtensors 2/2\n"
