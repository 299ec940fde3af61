"""The solution's side of a graded session. Runs inside the solution's sandbox, in the solution's own interpreter.

Why a server: to grade `f(x) == y` without running the comparison beside `f`, the grader (the host, or the judge
in another sandbox) asks this process to evaluate calls into the solution and answer with plain data
(plaindata.py). This process never sees a test, an expected value or a verdict; it only sees arguments. Whatever the
solution does to this interpreter (patch builtins, replace json, inspect frames) changes only the values it answers
with, and those are judged elsewhere.

Protocol (one JSON object per line; requests on fd 3, replies on fd 4):
    <- first:           {"setup": code run before the solution (the tests' imports)}
    -> after loading:   {"ready": true}  or  {"ready": false, "exc": name, "msg": text}
    <- {"id": n, "op": "call", "ref": R, "args": [...], "kwargs": [[name, value], ...]}
       ops: call, getattr (+"attr"), getitem (+"key"), iter, len, bool, str, repr
       R: {"name": "f"} (a global of the solution, dotted names follow attributes; a method of a `Solution` class
          when the solution defines one and no such global) or {"h": n} (a handle from an earlier answer)
    -> {"id": n, "ok": value}  or  {"id": n, "exc": name, "msg": text}
Arguments are passed by value: what the solution does to them never reaches the caller's objects (a test that
checks an argument mutated in place fails; in exchange the solution cannot alter values the test computes later).

stdlib only, nothing at import time: the host ships this source into the sandbox together with plaindata's.
"""

from __future__ import annotations

import builtins
import itertools
import json
import os
import sys

MAX_ITEMS = 1_000_000  # iterating a handle (a generator) materialises at most this many items


def _send(fd: int, obj) -> None:
    data = memoryview((json.dumps(obj, separators=(",", ":")) + "\n").encode())
    while data:
        data = data[os.write(fd, data) :]


def _describe(e: BaseException) -> dict:
    try:
        name = type(e).__name__
        msg = str(e)
    except BaseException:
        name, msg = "Exception", ""
    return {"exc": str(name)[:80], "msg": str(msg)[:300]}


def serve(pd, solution_path: str = "solution.py", rfd: int = 3, wfd: int = 4) -> None:
    """Read the setup code, load the solution, then answer requests until EOF on `rfd`."""
    reader = os.fdopen(rfd, "rb", buffering=1 << 16)
    try:
        setup = str(json.loads(reader.readline() or b"{}").get("setup") or "")
    except (ValueError, AttributeError):
        return
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)  # the solution's input() sees EOF, its prints go nowhere: neither is part of the protocol
    os.dup2(devnull, 1)
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # a solution may print or build huge ints; they cross as hex anyway
    g = {"__name__": "solution", "__builtins__": builtins, "__file__": solution_path}
    try:
        if setup:
            exec(compile(setup, "setup", "exec"), g)
        with open(solution_path, encoding="utf-8", errors="replace") as f:
            src = f.read()
        exec(compile(src, solution_path, "exec"), g)
    except BaseException as e:
        _send(wfd, dict(_describe(e), ready=False))
        return
    _send(wfd, {"ready": True})
    handles: dict = {}
    instance: list = []

    def resolve(ref):
        if type(ref) is not dict:
            raise LookupError("bad reference")
        if "h" in ref:
            return handles[ref["h"]]
        name = ref.get("name")
        if type(name) is not str or not name:
            raise LookupError("bad reference")
        head, *rest = name.split(".")
        if head in g:
            obj = g[head]
        elif not rest and isinstance(g.get("Solution"), type):  # LeetCode style: a method of class Solution
            if not instance:
                instance.append(g["Solution"]())
            obj = getattr(instance[0], head)
        else:
            raise NameError(f"name {head!r} is not defined by the solution")
        for part in rest:
            obj = getattr(obj, part)
        return obj

    def value(v):
        return pd.decode(v, make_handle=lambda n, _t: handles[n])

    for line in reader:
        try:
            req = json.loads(line)
            rid = req["id"]
        except (ValueError, KeyError, TypeError):
            return  # the host never sends this: stop rather than guess
        try:
            op, target = req.get("op"), resolve(req.get("ref"))
            if op == "call":
                args = [value(a) for a in req.get("args", [])]
                kwargs = {str(k): value(v) for k, v in req.get("kwargs", [])}
                result = target(*args, **kwargs)
            elif op == "getattr":
                result = getattr(target, str(req.get("attr")))
            elif op == "getitem":
                result = target[value(req.get("key"))]
            elif op == "iter":
                result = list(itertools.islice(iter(target), MAX_ITEMS))
            elif op == "len":
                result = len(target)
            elif op == "bool":
                result = bool(target)
            elif op in ("str", "repr"):
                result = str(target) if op == "str" else repr(target)
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"id": rid, "ok": pd.encode(result, handles)}
        except BaseException as e:
            reply = dict(_describe(e), id=rid)
        try:
            _send(wfd, reply)
        except (ValueError, TypeError, RecursionError) as e:
            _send(wfd, dict(_describe(e), id=rid))
