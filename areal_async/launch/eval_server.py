"""The server of eval.mode=pinned that the run starts itself: one embedded server on the controller's host.

It takes no rollouts and is in no weight-update group: it gets each version it evaluates by
/update_weights_from_disk, from a snapshot the controller made of that version (rollout/pinned_eval.py). It is a
child of its own `Processes` set, not of the cluster's, because its fate is not the run's: the cluster's watch ends
or recovers the run when one of its servers dies, while a dead eval server only costs the eval it was running (the
next eval starts it again). It dies with the controller (the children's parent-death signal) like every child.
"""

from __future__ import annotations

import logging

from areal_async.config import RunConfig
from areal_async.launch.processes import Child, Processes, embedded_server_cmd, thread_env

log = logging.getLogger(__name__)

NAME = "eval_server"  # its log is run_dir/logs/eval_server.log


class EvalServerProcess:
    """Starts the eval server on first use and again whenever it has exited; `url()` is the pinned evals'
    `server_url` hook."""

    def __init__(self, cfg: RunConfig, model_path: str) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.starts = 0
        self._procs: Processes | None = None
        self._child: Child | None = None

    def _start(self) -> Child:
        srv = self.cfg.server
        cmd = embedded_server_cmd(
            self.model_path,
            host=srv.host,
            port="0",  # it binds a free port and prints it in its ready line
            device=self.cfg.eval.device or srv.device,
            max_total_tokens=srv.max_total_tokens,
            max_running_requests=srv.max_running_requests,
            api_key=srv.api_key,
            prefix_cache=srv.prefix_cache,
            dtype=self.cfg.model.dtype,
        )
        if self._procs is None:
            self._procs = Processes(self.cfg.run_dir)
        self.starts += 1
        return self._procs.spawn(
            NAME, cmd, thread_env(srv.torch_threads), role="server", nice=_nice(self.cfg.eval.server_nice)
        )

    async def url(self) -> str:
        """The running server's URL, after starting it (first use, or it exited) and waiting for its /health."""
        child = self._child
        if child is not None and child.proc.poll() is None and child.url:
            return child.url
        if child is not None:
            log.warning(
                "the eval server exited (code %s): starting it again; log %s", child.proc.poll(), child.log_path
            )
        self._child = child = self._start()
        assert self._procs is not None
        await self._procs.wait_healthy([child], self.cfg.server.startup_timeout_s, self.cfg.server.api_key, only=True)
        assert child.url, "wait_healthy fills in the URL of a server started on port 0"
        return child.url

    def stop(self) -> None:
        """Stop it (at the end of the run, and at any teardown)."""
        if self._procs is not None:
            self._procs.shutdown()
        self._child = None


def _nice(configured: int | None) -> int:
    """eval.server_nice; null: 19, the eval only on cycles generation and training leave idle (its docstring)."""
    return 19 if configured is None else configured
