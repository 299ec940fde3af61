"""Import hygiene: the controller side never imports torch (a controller may run on a machine without it), the
package has no import cycles, and its floors hold (net/ at the bottom; see the rule table below). Both of the last
two read a static graph of every import statement in areal_async/, lazy ones included."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(REPO, "areal_async")

CONTROLLER_SIDE = [
    "areal_async.run",
    "areal_async.config",
    "areal_async.config.help",
    "areal_async.types",
    "areal_async.net.rpc",
    "areal_async.tokenizer",
    "areal_async.metrics",
    "areal_async.launch",
    "areal_async.launch.api",
    "areal_async.launch.local",
    "areal_async.launch.processes",
    "areal_async.launch.vllm_server",
    "areal_async.launch.recovery",
    "areal_async.launch.ray_launcher",
    "areal_async.testing.faults",
    "areal_async.rollout.controller",
    "areal_async.rollout.buffer",
    "areal_async.rollout.manager",
    "areal_async.rollout.samples",
    "areal_async.rollout.ledger",
    "areal_async.rollout.weight_sync",
    "areal_async.rollout.evaluate",
    "areal_async.rollout.chat",
    "areal_async.rollout.prompts",
    "areal_async.rollout.workflows",
    "areal_async.rollout.workflows.rlvr",
    "areal_async.rollout.workflows.multi_turn",
    "areal_async.inference.client",
    "areal_async.inference.transport",
    "areal_async.inference.routing",
    "areal_async.inference.resume",
    "areal_async.inference.sglang_wire",
    "areal_async.inference.vllm_dialect",
    "areal_async.inference.fleet",
    "areal_async.protocol.sglang",
    "areal_async.protocol.openai_requests",
    "areal_async.protocol.openai_responses",
    "areal_async.protocol.engine_api",
    "areal_async.net.rank_registry",
    "areal_async.net.address",
    "areal_async.train.client",
    "areal_async.agent",
    "areal_async.agent.openai_proxy",
    "areal_async.agent.episode",
    "areal_async.embed",
    "areal_async.host.cpu_features",
    "areal_async.session.prepare",
    "areal_async.model_store",
    "areal_async.plan",
    "areal_async.planner.simulate",
    "areal_async.planner.sweep",
    "areal_async.planner.report",
    "areal_async.planner.paper",
    "areal_async.planner.calibrate",
]

PROBE = """
import json, sys
mods = json.loads(sys.argv[1])
for m in mods:
    __import__(m)
from areal_async.config import load_config
from areal_async.run import prepare
cfg = load_config(None, ["model.path=" + sys.argv[2], "run_dir=" + sys.argv[3], "data.num_train=20",
                         "rollout.workflow=multi_turn"])
plan = prepare(cfg)  # the checks before launch: tokenizer, dataset, chat template, reward, workflow
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "safetensors"))
print(json.dumps(heavy))
"""


def test_controller_side_imports_no_torch(tiny_ckpt, tmp_path):
    p = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(CONTROLLER_SIDE), tiny_ckpt, str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    heavy = json.loads(p.stdout.strip().splitlines()[-1])
    assert heavy == [], heavy


SERVER_PROBE = """
import asyncio, json, sys
from areal_async.protocol.engine_api import EngineRequest, EngineSampling
from areal_async.server.engine import AsyncEngine

async def main():
    engine = AsyncEngine(sys.argv[1], device="cpu")
    await engine.start()
    ids = engine.encode("What is 2 + 3?")
    req = EngineRequest(rid="r", input_ids=ids, sampling=EngineSampling(max_new_tokens=4, stop=["."]))
    async for _ in engine.generate(req):
        pass
    engine.decode(ids)
    await engine.shutdown()

asyncio.run(main())
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "transformers")))
"""


def test_the_embedded_server_never_imports_transformers(tiny_ckpt):
    """The server reads tokenizer files with areal_async.tokenizer: importing transformers and loading its
    tokenizer took 1.7 s of a SmolLM2 server's start (of 5.6 s), and a weight-hot-swapping server restarts often."""
    p = subprocess.run(
        [sys.executable, "-c", SERVER_PROBE, tiny_ckpt], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []


def _modules() -> dict[str, str]:
    mods = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> package modules it imports anywhere (module level or inside functions; `if TYPE_CHECKING:`
    blocks excepted, since they never run)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        deps: set[str] = set()

        def visit(node: ast.AST) -> None:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for stmt in node.orelse:
                    visit(stmt)
                return
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = mod.split(".")
                    keep = len(parts) - node.level + (1 if path.endswith("__init__.py") else 0)
                    base = ".".join(parts[:keep] + ([base] if base else []))
                deps.add(base)
                deps.update(f"{base}.{a.name}" for a in node.names)
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(tree)
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_package_has_no_import_cycles():
    graph = import_graph()
    assert "areal_async.rollout.controller" in graph and graph["areal_async.run"]  # the graph is not empty
    assert cycles(graph) == []


# ---- floors ---------------------------------------------------------------------------------------------------------
#
# The folders of areal_async/ are floors: a module may import its own floor and the floors below it, never one above.
# The rules follow the processes (docs/design.md, "Three kinds of process"): the controller host is torch-free, the
# inference servers and the trainer ranks are processes of their own that the controller reaches over HTTP and RPC,
# and each of them must be importable without the parts that drive it. Checked on the static import graph above
# (lazy imports inside functions count: they run too), transitively, so a detour through a top-level module does not
# hide a violation. Starting a process by module name (`python -m areal_async.server`) is not an import and is not
# counted: that is how the launcher reaches the floors above it without importing them.
#
#   floor       may import only                       why
#   net/        net/ (and the leaves NET_MAY_USE)     the ground floor every process stands on: RPC, the registry,
#                                                     addresses, the custom process group
#   config/     config/                               the typed config, read by the controller and the trainer ranks
#
#   floor       never imports                         why
#   protocol/   inference/ server/ train/ rollout/    wire formats as pure functions, shared by the client, the
#               launch/                               embedded server, the agent proxy and the SGLang fake
#   inference/  server/ train/                        the controller's client must run without torch; the server it
#                                                     talks to is another process
#   server/     inference/ rollout/ launch/ train/    a server only answers HTTP (and joins a weight-update group);
#                                                     it knows nothing of who drives it
#   train/      launch/ rollout/ inference/           the trainer ranks are driven over RPC and know nothing of the
#                                                     schedule, the servers' client or the launchers
#   planner/    server/ train/ launch/ inference/     the capacity planner runs the schedule against models of the
#                                                     servers and trainers, in one torch-free process
#
# net/ uses one leaf outside itself (atomic_write, for the rank files) and config/ none; NET_MAY_USE names the
# leaves a net/ module may use without breaking the floor (they import nothing of the package, checked below).

PKG_NAME = "areal_async"
NET_MAY_USE = {"areal_async.types", "areal_async.config.base", "areal_async.atomic_write"}
ONLY = {  # floor -> what outside itself it may import
    "net": NET_MAY_USE,
    "config": set(),
}
NEVER = {  # floor -> floors it must not import
    "protocol": ["inference", "server", "train", "rollout", "launch"],
    "inference": ["server", "train"],
    "server": ["inference", "rollout", "launch", "train"],
    "train": ["launch", "rollout", "inference"],
    "planner": ["server", "train", "launch", "inference"],
}


def _on(mod: str, floor: str) -> bool:
    return mod == f"{PKG_NAME}.{floor}" or mod.startswith(f"{PKG_NAME}.{floor}.")


def _reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module `start` imports, directly or not -> the module that imports it on one shortest chain."""
    parent: dict[str, str] = {}
    todo = [start]
    while todo:
        nxt = []
        for m in todo:
            for d in sorted(graph[m]):
                if d != start and d not in parent:
                    parent[d] = m
                    nxt.append(d)
        todo = nxt
    return parent


def _chain(parent: dict[str, str], start: str, end: str) -> str:
    path = [end]
    while path[-1] != start:
        path.append(parent[path[-1]])
    return " -> ".join(reversed(path))


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import chain that breaks a rule of ONLY or NEVER, as 'a -> b -> c'."""
    bad = []
    for mod in sorted(graph):
        parent = _reach(graph, mod)
        for floor, allowed in ONLY.items():
            if _on(mod, floor):
                # The root package's __init__ imports nothing eagerly (checked below), so importing it is harmless.
                bad += [
                    _chain(parent, mod, d)
                    for d in sorted(parent)
                    if not _on(d, floor) and d not in allowed and d != PKG_NAME
                ]
        for floor, above in NEVER.items():
            if _on(mod, floor):
                bad += [_chain(parent, mod, d) for d in sorted(parent) if any(_on(d, a) for a in above)]
    return bad


def test_the_floor_check_finds_violations():
    graph = {
        "areal_async.net.rpc": {"areal_async.util"},
        "areal_async.util": {"areal_async.rollout.buffer"},
        "areal_async.rollout.buffer": set(),
        "areal_async.server.app": {"areal_async.protocol.sglang"},
        "areal_async.protocol.sglang": {"areal_async.types"},
        "areal_async.types": set(),
    }
    assert floor_violations(graph) == [
        "areal_async.net.rpc -> areal_async.util -> areal_async.rollout.buffer",
        "areal_async.net.rpc -> areal_async.util",
    ]
    graph["areal_async.net.rpc"] = {"areal_async.types"}
    graph["areal_async.protocol.sglang"] = {"areal_async.types", "areal_async.util"}
    assert floor_violations(graph) == [  # and through protocol/, the server reaches rollout/ too
        "areal_async.protocol.sglang -> areal_async.util -> areal_async.rollout.buffer",
        "areal_async.server.app -> areal_async.protocol.sglang -> areal_async.util -> areal_async.rollout.buffer",
    ]


def test_package_floors_hold():
    graph = import_graph()
    for floor in [*ONLY, *NEVER]:  # every floor named still exists, so no rule passes for want of modules
        assert any(_on(m, floor) for m in graph), f"no module in areal_async/{floor}/: update the rules"
    for leaf in [PKG_NAME, *NET_MAY_USE]:  # the modules the rules let through import nothing of the package
        assert graph[leaf] == set(), f"{leaf} imports {sorted(graph[leaf])}: it is no longer a leaf"
    assert floor_violations(graph) == []


MAX_MODULE_LINES = 600  # one concept per module; past this a module holds two and should be carved


def test_no_module_is_over_600_lines():
    """As formatted by ruff (`make lint`): a module that grows past the limit is carved, not squeezed."""
    long = {}
    for mod, path in _modules().items():
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_MODULE_LINES:
            long[mod] = n
    assert long == {}, long
