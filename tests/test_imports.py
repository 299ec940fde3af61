"""Import hygiene: the controller side never imports torch (a controller may run on a machine without it), and the
package has no import cycles (a static graph of every import statement in areal_async/, lazy ones included)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(REPO, "areal_async")

CONTROLLER_SIDE = [
    "areal_async.run", "areal_async.config", "areal_async.config.help", "areal_async.types", "areal_async.net.rpc",
    "areal_async.tokenizer", "areal_async.metrics",
    "areal_async.launch", "areal_async.launch.api", "areal_async.launch.local", "areal_async.launch.processes",
    "areal_async.launch.recovery", "areal_async.testing.faults",
    "areal_async.rollout.controller", "areal_async.rollout.buffer", "areal_async.rollout.manager",
    "areal_async.rollout.samples", "areal_async.rollout.ledger", "areal_async.rollout.weight_sync",
    "areal_async.rollout.evaluate", "areal_async.rollout.chat", "areal_async.rollout.prompts",
    "areal_async.rollout.workflows", "areal_async.rollout.workflows.rlvr", "areal_async.rollout.workflows.multi_turn",
    "areal_async.inference.client", "areal_async.inference.transport", "areal_async.inference.routing",
    "areal_async.inference.resume", "areal_async.inference.sglang_wire", "areal_async.inference.fleet",
    "areal_async.protocol.sglang", "areal_async.protocol.openai_requests", "areal_async.protocol.openai_responses",
    "areal_async.protocol.engine_api", "areal_async.net.registry", "areal_async.net.address", "areal_async.train.client",
    "areal_async.agent", "areal_async.agent.openai_proxy", "areal_async.agent.episode",
    "areal_async.embed", "areal_async.cpu_features", "areal_async.run_plan", "areal_async.model_store",
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
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CONTROLLER_SIDE), tiny_ckpt, str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    heavy = json.loads(p.stdout.strip().splitlines()[-1])
    assert heavy == [], heavy


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
