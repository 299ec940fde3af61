"""SGLang's command line for a LoRA run (`train.lora` with `server.backend=sglang`), and the adapter window it is
sized for. No torch here.

The flags are SGLang 0.5.x's (`server_args.py`: `add_cli_args` and `check_lora_server_args`): `--enable-lora`;
with no `--lora-paths` at launch SGLang needs both `--max-lora-rank` and `--lora-target-modules` to size its LoRA
memory pool (an adapter of a higher rank or other modules is refused at load); `--max-loras-per-batch` is how many
distinct adapters one batch may mix (default 8), and requests on the base model count as one of them, so it is the
window (eta + 1 versions) plus one. `--max-loaded-loras` is left unset: with it SGLang evicts the least recently
used adapter by itself, and a request naming an evicted one would be refused; the controller unloads the versions
that leave the window instead (rollout/lora_sync.py). A flag the user put in `server.extra_args` wins.
"""

from __future__ import annotations

from areal_async.config import ConfigError, RunConfig
from areal_async.launch.placement import sglang_flag

__all__ = ["adapter_window", "sglang_lora_args"]


def adapter_window(cfg: RunConfig) -> int:
    """How many adapter versions the servers keep loaded: eta + 1 (a request can be pinned to any version from
    v - eta to v while the trainers are at v; docs/weights.md, "LoRA on SGLang"). Needs a bounded eta."""
    eta = cfg.schedule.effective_eta
    if eta is None:
        raise ValueError("LoRA on SGLang keeps eta + 1 adapter versions loaded: schedule.eta must be bounded")
    return eta + 1


def sglang_lora_args(cfg: RunConfig, extra_args: list[str]) -> list[str]:
    """The LoRA flags `sglang.launch_server` needs for this run (none without train.lora)."""
    lora = cfg.train.lora
    if not lora.enabled or cfg.server.backend != "sglang":
        return []
    # the tokenizer manager asserts dp_size == 1 for every adapter load and unload (later builds also allow DP
    # attention): refused here rather than as a failed first update
    dp = sglang_flag(extra_args, "--dp-size", "--dp", "--data-parallel-size")
    if dp not in (None, "", "1") and sglang_flag(extra_args, "--enable-dp-attention") is None:
        raise ConfigError(
            f"server.extra_args: --dp-size {dp} with train.lora: SGLang loads adapters at run time only with "
            "dp_size 1; run one server per replica instead (server.num_servers)"
        )
    out: list[str] = []
    if sglang_flag(extra_args, "--enable-lora") is None:
        out.append("--enable-lora")
    if sglang_flag(extra_args, "--max-lora-rank") is None:
        out += ["--max-lora-rank", str(lora.rank)]
    if sglang_flag(extra_args, "--lora-target-modules") is None:
        out += ["--lora-target-modules", *lora.target_modules]
    if sglang_flag(extra_args, "--max-loras-per-batch") is None:
        out += ["--max-loras-per-batch", str(adapter_window(cfg) + 1)]
    return out
