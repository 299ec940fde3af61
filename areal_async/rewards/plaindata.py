"""Plain data across the sandbox boundary: values a solution computed, as JSON that can carry no behaviour.

Why: a grader that compares the solution's return value inside the solution's process can be told anything (an
object whose __eq__ is always true, a patched comparison helper, a no-op exec). Values cross to the grader as JSON
instead and are rebuilt there from builtin types only, so the comparison runs on genuine ints, strings and lists
whatever the solution did to its own interpreter. The encoder runs inside the untrusted process and may itself be
tampered with; that is fine, because all it can produce is data, and the data is judged against answers that the
solution's process never sees.

Encoding (JSON with tagged objects; a JSON object always carries a tag under "$"):
    None, bool, str, list, finite floats       as JSON (NaN and +-Infinity as Python's json writes them)
    int                                        JSON number, or {"$": "int", "v": hex} beyond 10**18
    tuple, set, frozenset, bytes, bytearray, complex, dict   {"$": tag, "v": ...} (dict: a list of [key, value])
    anything else                              {"$": "handle", "v": n, "type": name}: an opaque reference that the
                                               grader can call or inspect through the solution, never compare
Subclasses of builtin types cross as their base type's value (an int subclass with a forged __eq__ becomes a plain
int; a namedtuple a tuple; a Counter a dict).

This module is stdlib-only and has no import-time side effects, because its source is also shipped into the
sandbox (the solution server and the judge are built from it).
"""

from __future__ import annotations

import json
import math

MAX_DEPTH = 64
_BIG = 10**18
_MAX_HEX = 1 << 16  # hex digits of an int: ~78k decimal digits


class PlainDataError(ValueError):
    """A value that cannot cross, or a message that is not plain data."""


class Opaque:
    """Stand-in for a value that did not cross as data (a handle). Compares by identity only."""

    __slots__ = ("handle", "type_name")

    def __init__(self, handle: int, type_name: str) -> None:
        self.handle = handle
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name} object from the solution>"


def encode(value, handles=None, depth: int = 0):
    """A JSON-ready structure for `value`. A non-data object becomes a handle registered in `handles` when that is
    a dict, is passed to `handles` when that is a callable (which returns its encoding), and raises PlainDataError
    when `handles` is None."""
    if depth > MAX_DEPTH:
        raise PlainDataError("value nested too deeply")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if -_BIG < value < _BIG else {"$": "int", "v": _hex(value)}
    if t is float:
        return value
    d = depth + 1
    if t is list:
        return [encode(v, handles, d) for v in value]
    if t is tuple:
        return {"$": "tuple", "v": [encode(v, handles, d) for v in value]}
    if t is dict:
        return {"$": "dict", "v": [[encode(k, handles, d), encode(v, handles, d)] for k, v in value.items()]}
    if t is set or t is frozenset:
        return {"$": t.__name__, "v": [encode(v, handles, d) for v in value]}
    if t is bytes or t is bytearray:
        return {"$": t.__name__, "v": bytes(value).hex()}
    if t is complex:
        return {"$": "complex", "v": [value.real, value.imag]}
    # subclasses of builtin data types: their base value, through the base type's own methods
    if isinstance(value, bool):
        return bool.__bool__(value)
    if isinstance(value, int):
        return encode(int.__add__(value, 0), handles, d)
    if isinstance(value, float):
        return float.__mul__(value, 1.0)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return {"$": "bytes", "v": bytes.hex(bytes(value))}
    if isinstance(value, list):
        return [encode(v, handles, d) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"$": "tuple", "v": [encode(v, handles, d) for v in tuple.__iter__(value)]}
    if isinstance(value, dict):
        return {"$": "dict", "v": [[encode(k, handles, d), encode(v, handles, d)] for k, v in dict.items(value)]}
    if isinstance(value, (set, frozenset)):
        tag = "frozenset" if isinstance(value, frozenset) else "set"
        base = frozenset if tag == "frozenset" else set
        return {"$": tag, "v": [encode(v, handles, d) for v in base.__iter__(value)]}
    if handles is None:
        raise PlainDataError(f"a {type(value).__name__} object is not plain data")
    if callable(handles):
        return handles(value)
    n = len(handles) + 1
    handles[n] = value
    name = getattr(t, "__name__", "object")
    return {"$": "handle", "v": n, "type": name[:80] if type(name) is str else "object"}


def _hex(value: int) -> str:
    text = hex(value)
    if len(text) > _MAX_HEX:
        raise PlainDataError("integer too large")
    return text


def decode(obj, make_handle=None, depth: int = 0):
    """Rebuild a value from `encode`'s output using builtin types only. `make_handle(n, type_name)` turns a handle
    into whatever the caller wants (default: an Opaque). Raises PlainDataError on anything malformed."""
    if depth > MAX_DEPTH + 2:
        raise PlainDataError("value nested too deeply")
    t = type(obj)
    if obj is None or t is bool or t is str or t is int or t is float:
        return obj
    d = depth + 1
    if t is list:
        return [decode(v, make_handle, d) for v in obj]
    if t is not dict or type(obj.get("$")) is not str:
        raise PlainDataError(f"not plain data: {t.__name__}")
    tag, v = obj["$"], obj.get("v")
    try:
        if tag == "int" and type(v) is str and len(v) <= _MAX_HEX:
            return int(v, 16)
        if tag in ("tuple", "set", "frozenset") and type(v) is list:
            items = [decode(x, make_handle, d) for x in v]
            return tuple(items) if tag == "tuple" else set(items) if tag == "set" else frozenset(items)
        if tag == "dict" and type(v) is list:
            out = {}
            for pair in v:
                if type(pair) is not list or len(pair) != 2:
                    raise PlainDataError("malformed dict entry")
                out[decode(pair[0], make_handle, d)] = decode(pair[1], make_handle, d)
            return out
        if tag in ("bytes", "bytearray") and type(v) is str:
            return bytes.fromhex(v) if tag == "bytes" else bytearray.fromhex(v)
        if tag == "complex" and type(v) is list and len(v) == 2 and all(type(x) in (int, float) for x in v):
            return complex(v[0], v[1])
        if tag == "handle" and type(v) is int:
            name = obj.get("type")
            name = name[:80] if type(name) is str else "object"
            return make_handle(v, name) if make_handle else Opaque(v, name)
    except TypeError as e:  # unhashable keys or set members
        raise PlainDataError(str(e)) from None
    except ValueError as e:
        raise PlainDataError(str(e)) from None
    raise PlainDataError(f"unknown or malformed tag {tag[:40]!r}")


def dumps(value, handles=None) -> str:
    """One line of JSON (json never writes a raw newline)."""
    return json.dumps(encode(value, handles), separators=(",", ":"))


def loads(text, make_handle=None):
    """Parse and rebuild; PlainDataError on malformed input (deep nesting included)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise PlainDataError(f"malformed JSON: {str(e)[:100]}") from None
    try:
        return decode(obj, make_handle)
    except RecursionError:
        raise PlainDataError("value nested too deeply") from None


def values_match(got, want, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> bool:
    """Does the solution's value `got` equal the expected `want`? Exact for ints, strings, bools and None;
    a tolerance only where the expected value is a float. Lists and tuples compare as sequences (datasets store
    tuples as JSON lists); dict keys and set members compare exactly."""
    tw, tg = type(want), type(got)
    if tw is float:
        if tg not in (int, float):
            return False
        if math.isnan(want):
            return math.isnan(got)
        return math.isclose(float(got), want, rel_tol=rel_tol, abs_tol=abs_tol)
    if tw is bool or tg is bool:
        return tw is tg and got == want
    if tw is int:
        return (tg is int and got == want) or (tg is float and math.isfinite(got) and got == want)
    if tw in (list, tuple):
        return (
            tg in (list, tuple)
            and len(got) == len(want)
            and all(values_match(g, w, rel_tol, abs_tol) for g, w in zip(got, want))
        )
    if tw is dict:
        return (
            tg is dict
            and got.keys() == want.keys()
            and all(values_match(got[k], want[k], rel_tol, abs_tol) for k in want)
        )
    if tw in (set, frozenset):
        return tg in (set, frozenset) and got == want
    if tw in (str, bytes, bytearray, complex) or want is None:
        return tg is tw and got == want
    return False
