"""The package's layers (docs: /work/shared/DESIGN.md's import direction, and the layer table below), checked on a
static import graph that, unlike tests/test_imports.py's, also holds the imports made for type checkers only
(`if TYPE_CHECKING:`) and `importlib.import_module("areal_async....")` calls with a literal name.

Three rules:
- no import cycle, type-only imports included: a type-only cycle is still two modules a reader must hold in their
  head together (and the first step to a runtime one);
- no upward import: every module sits on one layer of LAYERS and imports only its own layer and those below;
- the torch processes (the inference server, the trainer ranks) are reached by command line or RPC, never imported
  from the controller side (only by one another, by the test support in testing/ and by the `serve` command shim).

Module size (600 lines at most) is tests/test_imports.py's `test_no_module_is_over_600_lines`; the top level's size
is TOP_LEVEL_BUDGET below.
"""

from __future__ import annotations

import ast

from test_imports import PKG_NAME, _modules, cycles

# ---- the layers, bottom first -----------------------------------------------------------------------------------
#
# Each entry names module prefixes under areal_async (a package or one module); a module belongs to the entry with
# the longest prefix that matches it, so train/client.py (the controller's side of the trainers) sits low while
# the rest of train/ (the torch ranks) does not. Every module must belong somewhere: a new top-level module or
# package is a decision about its layer, made here.

ROOT = ""  # areal_async/__init__.py: the lazy facade over session/embed.py
# The torch-free modules of train/: what the controller uses to drive the trainer ranks over RPC (and the packing
# rules both sides apply). The rest of train/ is the ranks themselves.
TRAIN_CLIENT_SIDE = ["train.client", "train.messages", "train.errors", "train.broadcast_driver", "train.packing"]
LAYERS: list[tuple[str, list[str]]] = [
    # what every process stands on; none of it imports anything above (config/ and net/ have stricter floors in
    # tests/test_imports.py)
    ("ground", ["types", "atomic_write", "config", "net", "protocol", "host"]),
    # small helpers shared by controller and processes: files, tokenizer, metrics, weight formats
    ("shared", ["cache", "progress", "chat_template", "tokenizer", "metrics", "metrics_sinks", "weights"]),
    # the controller's view of what it drives: the inference client, the trainer client, rewards, tasks, models
    (
        "clients",
        [
            "inference",
            *TRAIN_CLIENT_SIDE,
            "rewards",
            "tasks",
            "model_store",
        ],
    ),
    # the torch processes, each a program of its own (see TORCH_PROCESSES): the embedded server, the trainer ranks
    ("processes", ["server", "train"]),
    # the controller: the schedule, the buffer, the weight sync, the workflows
    ("controller", ["rollout"]),
    # what runs the controller: agents' proxy, the capacity planner (the real schedule in virtual time)
    ("over the controller", ["agent", "planner"]),
    # starting, watching and restarting the processes
    ("launch", ["launch"]),
    # one run top to bottom, the commands under their first names, the facade, the test support
    ("session", ["session", "run", "embed", "plan", "serve", "testing", ROOT]),
]

# Reached by command line (python -m areal_async.server, torchrun ... train.worker) or RPC, never imported by the
# controller side. May be imported only from these prefixes:
TORCH_PROCESSES = ["server", "train"]
MAY_IMPORT_PROCESSES = ["server", "train", "testing", "serve"]

# The package's first level: entry-point shims and a few true utilities beside the packages (issue 46).
TOP_LEVEL_BUDGET = 13


def _under(mod: str, prefix: str) -> bool:
    """`mod` (a full dotted name) is `areal_async.<prefix>` or inside it; the empty prefix is the root itself."""
    if not prefix:
        return mod == PKG_NAME
    full = f"{PKG_NAME}.{prefix}"
    return mod == full or mod.startswith(full + ".")


def layer_of(mod: str, layers: list[tuple[str, list[str]]] = LAYERS) -> int | None:
    """Index of `mod`'s layer in `layers` (longest matching prefix), None when no entry names it."""
    best: tuple[int, int] | None = None  # (prefix length, layer index)
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if _under(mod, p) and (best is None or len(p) > best[0]):
                best = (len(p), i)
    return None if best is None else best[1]


def full_import_graph() -> dict[str, set[str]]:
    """module -> package modules it imports anywhere, `if TYPE_CHECKING:` blocks included.

    `from areal_async.x import name` counts as an import of `areal_async.x.name` when that is a module, else of
    `areal_async.x` (whose __init__ defines the name): the parents a submodule import runs are not counted, since
    a package's own __init__ is on its package's layer anyway."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = mod.split(".")
                    keep = len(parts) - node.level + (1 if path.endswith("__init__.py") else 0)
                    base = ".".join(parts[:keep] + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    deps.add(sub if sub in mods else base)
            elif (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("importlib.import_module", "import_module")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                deps.add(node.args[0].value)
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, list[str]]] = LAYERS) -> list[str]:
    """Every direct import of a higher layer, as 'a (layer) -> b (layer)'."""
    bad = []
    for mod in sorted(graph):
        mine = layer_of(mod, layers)
        for dep in sorted(graph[mod]):
            theirs = layer_of(dep, layers)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{mod} ({layers[mine][0]}) -> {dep} ({layers[theirs][0]})")
    return bad


def _torch_side(mod: str) -> bool:
    on_process = max((len(p) for p in TORCH_PROCESSES if _under(mod, p)), default=-1)
    on_client = max((len(p) for p in TRAIN_CLIENT_SIDE if _under(mod, p)), default=-1)
    return on_process > on_client


def process_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a torch process's module from outside the processes (and MAY_IMPORT_PROCESSES)."""
    return [
        f"{mod} -> {dep}"
        for mod in sorted(graph)
        if not any(_under(mod, p) for p in MAY_IMPORT_PROCESSES)
        for dep in sorted(graph[mod])
        if _torch_side(dep)
    ]


def test_the_layer_checks_find_violations():
    layers = [("low", ["types", "train.client"]), ("mid", ["train"]), ("high", ["session", ""])]
    assert layer_of("areal_async.train.client", layers) == 0  # the longest prefix wins
    assert layer_of("areal_async.train.worker", layers) == 1
    assert layer_of("areal_async", layers) == 2 and layer_of("areal_async.types", layers) == 0
    assert layer_of("areal_async.other", layers) is None
    graph = {
        "areal_async.types": {"areal_async.session.run"},
        "areal_async.train.worker": {"areal_async.types", "areal_async.train.client"},
        "areal_async.session.run": {"areal_async.train.worker"},
    }
    assert upward_imports(graph, layers) == ["areal_async.types (low) -> areal_async.session.run (high)"]
    assert process_imports(graph) == ["areal_async.session.run -> areal_async.train.worker"]


def test_the_graph_holds_type_only_imports():
    graph = full_import_graph()
    # session/report.py imports RunPlan for its annotations only, and the root facade names embed's types so
    assert "areal_async.session.prepare" in graph["areal_async.session.report"]
    assert "areal_async.embed" in graph["areal_async"]


def test_no_import_cycles_type_only_imports_included():
    assert cycles(full_import_graph()) == []


def test_every_module_has_a_layer():
    graph = full_import_graph()
    assert [m for m in sorted(graph) if layer_of(m) is None] == []
    for _, prefixes in LAYERS:  # and every prefix still names something, so no rule passes for want of modules
        for p in prefixes:
            assert any(_under(m, p) for m in graph), f"no module areal_async.{p}: update LAYERS"


def test_no_module_imports_a_layer_above_its_own():
    assert upward_imports(full_import_graph()) == []


def test_only_the_processes_import_the_processes():
    assert process_imports(full_import_graph()) == []


def test_the_top_level_stays_small():
    """Beside the packages, the first level holds the commands' shims and a few utilities; a new one is a choice."""
    top = sorted(m for m, path in _modules().items() if m.count(".") == 1 and not path.endswith("__init__.py"))
    assert len(top) <= TOP_LEVEL_BUDGET, top
