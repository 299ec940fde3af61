"""Metrics sinks: where a run's records go besides metrics.jsonl.

metrics.jsonl is the source of truth (areal_async/metrics.py writes it, and it is what a resume cuts back and what
progress.png is drawn from). Every record written there is also handed to the run's sinks: the built-in TensorBoard
one (the [tensorboard] extra), and the ones `metrics.loggers` names: "wandb" (the [wandb] extra) or "module:factory",
a callable of no arguments returning a sink of your own. A sink is an object with

    open(run: RunInfo) -> None          once, when the run has its directory (optional)
    log(record: dict) -> None           once per record, in the order they were written
    close() -> None                     once, at the end of the run (optional)

A record is exactly what one line of metrics.jsonl holds (a fresh copy, parsed back from the line):
{"kind": "train" | "eval" | "recovery", "step": <policy version>, "time": <unix seconds>, ...values}.

A sink never stops the run or costs it a record: the configured sinks run in one background thread fed by a queue,
so a slow sink never holds up the controller's event loop, and a sink that raises is reported once (a warning naming
it) and handed the next records all the same; one whose open() fails is dropped with a warning. At the end of the
run the thread gets `close_timeout_s` to finish the queue and close the sinks. The sinks of a run outlive one
metrics writer: a trainer rollback (`roll_back`) closes metrics.jsonl, cuts it back and opens a new writer, which
is handed the same sinks; records of the steps a rollback redoes reach the sinks a
second time (metrics.jsonl keeps only the new ones).

Never torch, and nothing imported that a run does not use: wandb is imported when its sink opens.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import logging
import os
import queue
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from areal_async.config.base import ConfigError

log = logging.getLogger("areal_async.metrics")

__all__ = [
    "BUILTIN_LOGGERS",
    "MetricsSink",
    "RunInfo",
    "SinkSet",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
    "scalars",
]

BUILTIN_LOGGERS = ("wandb",)
WANDB_ID_FILE = "wandb_run_id"  # in the run directory: a resumed run goes on logging into the same wandb run


@dataclass(frozen=True)
class RunInfo:
    """What a sink learns about the run when it opens."""

    run_dir: str
    """The run directory, absolute."""
    name: str
    """Its last component (the default wandb run name)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The resolved run config, as config.json holds it."""
    resumed_version: int | None = None
    """The checkpoint version the run resumed from; None for a fresh start."""

    @classmethod
    def of(cls, run_dir: str, config: dict[str, Any], resumed_version: int | None = None) -> RunInfo:
        full = os.path.abspath(run_dir)
        return cls(full, os.path.basename(full), config, resumed_version)


@runtime_checkable
class MetricsSink(Protocol):
    """The interface a sink offers; `open` and `close` may be left out (see the module docstring)."""

    def open(self, run: RunInfo) -> None: ...

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numeric values (bools and text left out), without its kind, step and time."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in ("kind", "step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


# ---- the built-in sinks -----------------------------------------------------------------------------------------


class TensorBoardSink:
    """Numeric values as TensorBoard scalars `<kind>/<key>` at the record's step, in `run_dir/tensorboard`, with
    the tensorboard package's own event writer (no torch). `available()` is False without the [tensorboard] extra."""

    def __init__(self, run_dir: str) -> None:
        self._writer: Any = None
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:  # the [tensorboard] extra; a run never dies for want of it
            return
        self._writer = EventFileWriter(os.path.join(run_dir, "tensorboard"))

    def available(self) -> bool:
        return self._writer is not None

    def log(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            return
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        kind = record["kind"]
        vals = [Summary.Value(tag=f"{kind}/{k}", simple_value=v) for k, v in scalars(record).items()]
        if vals:
            self._writer.add_event(Event(wall_time=record["time"], step=record["step"], summary=Summary(value=vals)))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """Weights & Biases (the [wandb] extra, imported on open). Numeric values are logged as `<kind>/<key>` against
    the record's policy version (`version`, wandb's x-axis for them), never as wandb's own step: a rollback redoes
    versions, and wandb drops records whose step goes back. The run config is the wandb run's config; the wandb run
    id is kept in the run directory, so a resumed run logs into the same wandb run."""

    def __init__(self, options: Any = None) -> None:
        self.options = options  # a WandbConfig (config/run_config.py); None: every default
        self._run: Any = None
        self._kinds: set[str] = set()  # the kinds whose `<kind>/*` metrics are plotted against `version`

    def open(self, run: RunInfo) -> None:
        import wandb

        o = self.options
        os.makedirs(run.run_dir, exist_ok=True)
        id_file = os.path.join(run.run_dir, WANDB_ID_FILE)
        run_id = None
        if run.resumed_version is not None and os.path.isfile(id_file):
            with open(id_file) as f:
                run_id = f.read().strip() or None
        run_id = run_id or secrets.token_hex(4)  # wandb's own id shape: 8 characters of [a-z0-9]
        wandb_dir = (o.dir if o is not None else None) or os.environ.get("WANDB_DIR") or run.run_dir
        os.makedirs(wandb_dir, exist_ok=True)
        kwargs: dict[str, Any] = {
            "project": o.project if o is not None else "areal_async",
            "name": (o.name if o is not None else None) or run.name,
            "config": run.config,
            "dir": wandb_dir,
            "id": run_id,
            "resume": "allow",
            # no console capture: wandb would wrap this process's stdout and stderr, which the run's logging uses
            "settings": wandb.Settings(console="off"),
        }
        if o is not None:
            kwargs.update({k: getattr(o, k) for k in ("entity", "group", "mode") if getattr(o, k) is not None})
            if o.tags:
                kwargs["tags"] = list(o.tags)
        self._run = wandb.init(**kwargs)
        self._run.define_metric("version")
        self._kinds.clear()
        with open(id_file, "w") as f:
            f.write(run_id + "\n")

    def log(self, record: dict[str, Any]) -> None:
        if self._run is None:
            return
        kind = record["kind"]
        values = {f"{kind}/{k}": v for k, v in scalars(record).items()}
        if not values:
            return
        if kind not in self._kinds:
            self._kinds.add(kind)
            self._run.define_metric(f"{kind}/*", step_metric="version")
        self._run.log({**values, "version": record["step"]})

    def close(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()


# ---- naming sinks in the config ---------------------------------------------------------------------------------


def _factory_of(entry: str, key: str) -> Any:
    module, _, attr = entry.partition(":")
    if not module or not attr:
        raise ConfigError(
            f"{key}: {entry!r} is neither a built-in logger ({', '.join(BUILTIN_LOGGERS)}) nor an "
            "import path module:factory"
        )
    try:
        obj: Any = importlib.import_module(module)
    except Exception as e:  # an import error, or anything the module raises while it loads
        raise ConfigError(f"{key}: cannot import {module!r} for {entry!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: {module!r} has no {attr!r} (for {entry!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: {entry!r} is not callable (a factory of no arguments returning a sink)")
    return obj


def build_sinks(entries: list[str], wandb_options: Any = None, key: str = "metrics.loggers") -> list[tuple[str, Any]]:
    """The sinks `entries` (metrics.loggers) name, made but not opened, as (name, sink) pairs. Checked before
    launch: an unknown name, a missing package, a module that does not import, a factory that raises or returns
    something without a `log` method is a ConfigError naming `key`."""
    out: list[tuple[str, Any]] = []
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if entry == "wandb":
            if importlib.util.find_spec("wandb") is None:  # found, not imported: the import is seconds
                raise ConfigError(f"{where}: wandb is not installed; pip install 'areal_async[wandb]'")
            out.append((entry, WandbSink(wandb_options)))
            continue
        factory = _factory_of(entry, where)
        try:
            sink = factory()
        except Exception as e:
            raise ConfigError(f"{where}: {entry}() raised {type(e).__name__}: {e}") from None
        if not callable(getattr(sink, "log", None)):
            raise ConfigError(f"{where}: {entry}() returned {type(sink).__name__}, which has no log(record) method")
        out.append((entry, sink))
    return out


# ---- the run's sinks ---------------------------------------------------------------------------------------------


class SinkSet:
    """A run's extra sinks behind one queue and one thread (see the module docstring). `log` never raises and
    never blocks; `close` waits at most `close_timeout_s` for the thread to finish the queue and close the sinks."""

    def __init__(self, sinks: list[tuple[str, Any]] | None = None, close_timeout_s: float = 30.0) -> None:
        self.sinks = list(sinks or [])
        self.close_timeout_s = close_timeout_s
        self.failures: collections.Counter[str] = collections.Counter()  # records each sink raised on
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def open(self, run: RunInfo) -> SinkSet:
        """Open every sink (one that raises is dropped, with a warning), start the thread, and attach the set to
        `run.run_dir` for the run's metrics writers to find."""
        if not self.sinks or self._thread is not None:
            return self
        kept = []
        for name, sink in self.sinks:
            opener = getattr(sink, "open", None)
            try:
                if callable(opener):
                    opener(run)
            except Exception as e:
                log.warning(
                    "metrics logger %s failed to open (%s: %s); the run goes on without it", name, type(e).__name__, e
                )
                continue
            kept.append((name, sink))
        self.sinks = kept
        self._thread = threading.Thread(target=self._work, name="metrics-sinks", daemon=True)
        self._thread.start()
        return self

    def log(self, record: dict[str, Any]) -> None:
        if self._thread is not None:
            self._queue.put(record)

    def _work(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                break
            for name, sink in self.sinks:
                try:
                    sink.log(record)
                except Exception as e:
                    self.failures[name] += 1
                    if self.failures[name] == 1:
                        log.warning(
                            "metrics logger %s raised on a %s record (%s: %s); it gets the next records "
                            "all the same, and metrics.jsonl has every one",
                            name,
                            record.get("kind"),
                            type(e).__name__,
                            e,
                        )
        for name, sink in self.sinks:
            closer = getattr(sink, "close", None)
            try:
                if callable(closer):
                    closer()
            except Exception as e:
                log.warning("metrics logger %s failed to close (%s: %s)", name, type(e).__name__, e)

    def close(self) -> None:
        """Finish the queue, close the sinks and detach; once (later calls do nothing)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(self.close_timeout_s)
        if thread.is_alive():
            log.warning(
                "metrics loggers still busy %.0fs after the run ended; left behind (metrics.jsonl has every record)",
                self.close_timeout_s,
            )
        for name, n in sorted(self.failures.items()):
            if n > 1:
                log.warning("metrics logger %s raised on %d records", name, n)
