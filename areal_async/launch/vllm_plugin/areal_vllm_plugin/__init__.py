"""areal_async's weight-transfer engine for vLLM, as a vLLM general plugin (entry point `areal_c10d`).

vLLM's own transfer engines (nccl, ipc, ...) are CUDA-only and rendezvous through vLLM's StatelessProcessGroup,
which the project's trainer does not speak. This engine joins the trainer's weight-update group exactly as SGLang's
`init_weights_update_group` does (a torch c10d group on the trainer's TCPStore, `PrefixStore(group_name)`): gloo on
a CPU, so vLLM-CPU can take `train.weight_sync=broadcast`. See `engine.py` for the engine, docs/inference.md
("vLLM") for the mapping of the controller's calls onto vLLM's four-phase transfer.

How it is found: launch/vllm_server.py puts the folder above this package on vLLM's PYTHONPATH, where
`importlib.metadata` finds the `areal_vllm_plugin-1.0.dist-info` beside it, and with it the `vllm.general_plugins`
entry point; vLLM calls `register` in every process it starts (API server, engine core, workers). Nothing is
installed into vLLM's venv and vLLM is not patched. The server selects the engine with
`--weight-transfer-config '{"backend": "areal_c10d"}'`.

It runs in vLLM's interpreter, so it imports nothing from areal_async (another venv), and importing it has no side
effects: registration happens when vLLM calls `register`, and the engine module (which imports torch and vLLM) is
imported only when vLLM creates the engine.
"""

from __future__ import annotations

ENGINE_NAME = "areal_c10d"

__all__ = ["ENGINE_NAME", "register"]


def register() -> None:
    """Register the engine under `ENGINE_NAME` with vLLM's weight-transfer factory, lazily (by module path).

    vLLM may call a plugin more than once per process; a second registration is refused by the factory with a
    ValueError, which means the engine is there already."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, "areal_vllm_plugin.engine", "C10dWeightTransferEngine")
    except ValueError:
        pass  # registered already in this process
