"""The judge: runs a dataset's test code (asserts, a HumanEval `check`) in its own sandbox, without the solution.

Why: test code such as `assert abs(f(x) - 2.5) < 1e-6` or `check(candidate)` needs a Python interpreter to run,
and running it beside the solution lets the solution rebind `abs`, patch `exec` or inspect the test's frames. The
judge runs the test code with genuine builtins in a separate process (another uid, other namespaces, not dumpable),
where every name the tests expect from the solution is a `Remote` proxy: calling it sends the call to the solution's
server (through the host), and the answer comes back as plain data rebuilt from builtin types. Arguments travel by
value, so nothing the solution does reaches the judge's objects. An object the solution
returns that is not data stays a proxy, and a proxy compares by identity, so an "always equal" object equals
nothing. The judge reports each test's outcome to the host, which alone decides the reward.

Protocol (JSON lines; from the host on fd 3, to the host on fd 4):
    <- {"tests": [src, ...], "setup": src, "proxies": [name, ...], "modules": [name, ...], "first": k}
    -> {"start": i} ... {"rpc": request}  <- reply ...  -> {"result": i, "ok": bool, "exc": name}
    -> {"setup_error": name, "msg": text}   or   {"done": true}
A reply to an rpc is the server's answer ({"ok": ...} / {"exc": ...}) or {"lost": reason} when the solution's process
hit a limit or died; `lost` raises SolutionLost, which no test should catch (and the host fails the test anyway).

stdlib only, nothing at import time: the host ships this source into the judge's sandbox with plaindata's.
"""

from __future__ import annotations

import builtins
import importlib
import itertools
import json
import os


class SolutionError(Exception):
    """The solution raised an exception that is not a builtin one."""


class SolutionLost(BaseException):
    """The solution's process hit a limit or died during the call (BaseException: `except Exception` won't eat it)."""


class _Link:
    def __init__(self, pd, rfd: int, wfd: int) -> None:
        self.pd = pd
        self.wfd = wfd
        self.reader = os.fdopen(rfd, "rb", buffering=1 << 16)
        self.ids = itertools.count(1)

    def send(self, obj) -> None:
        data = memoryview((json.dumps(obj, separators=(",", ":")) + "\n").encode())
        while data:
            data = data[os.write(self.wfd, data) :]

    def read(self):
        line = self.reader.readline()
        if not line:
            raise SystemExit(0)  # the host went away
        return json.loads(line)

    def arg(self, value):
        def on_object(obj):
            if isinstance(obj, Remote) and "h" in obj._ref:
                return {"$": "handle", "v": obj._ref["h"]}
            raise TypeError(f"cannot pass a {type(obj).__name__} to the solution")

        return self.pd.encode(value, on_object)

    def rpc(self, op: str, ref: dict, **fields):
        rid = next(self.ids)
        self.send({"rpc": dict(fields, id=rid, op=op, ref=ref)})
        reply = self.read()
        if "lost" in reply:
            raise SolutionLost(str(reply["lost"]))
        if "exc" in reply:
            name, msg = str(reply.get("exc")), str(reply.get("msg", ""))
            exc = getattr(builtins, name, None)
            err = None
            if isinstance(exc, type) and issubclass(exc, Exception) and exc.__module__ == "builtins":
                try:
                    err = exc(msg)
                except Exception:  # exception types whose constructor wants more arguments
                    err = None
            raise err if err is not None else SolutionError(f"{name}: {msg}")
        return self.pd.decode(reply.get("ok"), make_handle=lambda n, t: Remote(self, {"h": n}, t))


class Remote:
    """A name or object that lives in the solution's process. Calls and inspection go there; comparisons do not."""

    __slots__ = ("_link", "_ref", "_label")

    def __init__(self, link: _Link, ref: dict, label: str) -> None:
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_label", label)

    def __call__(self, *args, **kwargs):
        link = self._link
        return link.rpc(
            "call", self._ref, args=[link.arg(a) for a in args], kwargs=[[k, link.arg(v)] for k, v in kwargs.items()]
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._link.rpc("getattr", self._ref, attr=name)

    def __getitem__(self, key):
        return self._link.rpc("getitem", self._ref, key=self._link.arg(key))

    def __iter__(self):
        items = self._link.rpc("iter", self._ref)
        if type(items) is not list:
            raise TypeError("iteration did not produce a list")
        return iter(items)

    def __len__(self) -> int:
        n = self._link.rpc("len", self._ref)
        if type(n) is not int or n < 0:
            raise TypeError("len() of a solution object is not a non-negative int")
        return n

    def __bool__(self) -> bool:
        b = self._link.rpc("bool", self._ref)
        if type(b) is not bool:
            raise TypeError("bool() of a solution object is not a bool")
        return b

    def __str__(self) -> str:
        s = self._link.rpc("str", self._ref)
        return s if type(s) is str else "<?>"

    def __repr__(self) -> str:
        s = self._link.rpc("repr", self._ref)
        return s if type(s) is str else "<?>"

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__

    def __setattr__(self, name, value):
        raise AttributeError("solution objects are read-only from the tests")


def _describe(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)[:200]


def _not_dumpable() -> None:
    """Processes of the same uid (the solution, when there are no namespaces) cannot read or write our memory
    through /proc/<pid>/mem then. Must run after exec: execve makes a process dumpable again."""
    try:
        import ctypes

        z = ctypes.c_ulong(0)
        ctypes.CDLL(None).prctl(ctypes.c_int(4), z, z, z, z)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def judge(pd, rfd: int = 3, wfd: int = 4) -> None:
    _not_dumpable()
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # test code's prints are not part of the protocol
    link = _Link(pd, rfd, wfd)
    cfg = link.read()
    g = {"__name__": "__main__", "__builtins__": builtins}
    try:
        if cfg.get("setup"):
            exec(compile(cfg["setup"], "setup", "exec"), g)
    except BaseException as e:
        name, msg = _describe(e)
        link.send({"setup_error": name, "msg": msg})
        return
    for name in cfg.get("modules", []):
        if name not in g:
            try:
                g[name] = importlib.import_module(name)
            except Exception:
                pass  # a test that uses it fails with NameError, the others still run
    for name in cfg.get("proxies", []):
        if name not in g:
            g[name] = Remote(link, {"name": name}, name)
    tests = cfg.get("tests", [])
    for i in range(int(cfg.get("first", 0)), len(tests)):
        link.send({"start": i})
        try:
            exec(compile(tests[i], f"test_{i}", "exec"), g)
            link.send({"result": i, "ok": True})
        except BaseException as e:
            name, _msg = _describe(e)
            link.send({"result": i, "ok": False, "exc": name})
    link.send({"done": True})
