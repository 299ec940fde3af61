"""GPU placement and the broadcast group's layout, decided before launch and from the servers' own answers
(launch/placement.py, rollout/broadcast_group.py): which GPU each server and trainer agent gets on hosts of 0, 1, 2
and 8 GPUs, the layouts that are refused (naming the key), SGLang's --tp-size on the command line, tensor-parallel
rank counts from /get_server_info (SGLang's real field names), and the gloo fallback when a server shares the
trainer's GPU. Pure functions, and one real embedded server for its reported layout."""

from __future__ import annotations

import shlex
import sys

import pytest

from areal_async.config import ConfigError, load_config
from areal_async.launch.placement import plan_placement, sglang_flag, visible_gpus
from areal_async.launch.processes import Processes, sglang_server_cmd
from areal_async.rollout.broadcast_group import BroadcastLayoutError, group_backend, plan_group, server_ranks


def cfg(*overrides: str):
    return load_config(None, list(overrides))


GPUS8 = tuple(str(i) for i in range(8))


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5, 7"}) == ("4", "5", "7")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,3"}) == ("2",)  # CUDA stops at the first invalid entry


def test_cpu_host_places_nothing():
    p = plan_placement(cfg("server.num_servers=3", "train.nproc=2"), gpus=())
    assert p.servers == ((), (), ()) and p.server_devices == ("auto",) * 3 and p.server_visible == (None,) * 3
    assert p.trainer_visible == (None,) and p.shared == ()


def test_embedded_servers_get_their_own_gpus_and_trainers_the_next_free_ones():
    p = plan_placement(cfg("server.num_servers=3", "train.nproc=2"), gpus=GPUS8)
    assert p.servers == ((0,), (1,), (2,))
    assert p.server_visible == ("0", "1", "2") and p.server_devices == ("auto",) * 3  # "auto" there = its GPU
    assert p.trainer_visible == ("3,4",) and p.shared == ()
    # base_gpu_id and a stride of gpus_per_server; the controller's own CUDA_VISIBLE_DEVICES is respected
    p = plan_placement(
        cfg("server.num_servers=2", "server.base_gpu_id=1", "server.gpus_per_server=2"), gpus=("4", "5", "6", "7", "9")
    )
    assert p.servers == ((1,), (3,)) and p.server_visible == ("5", "7") and p.trainer_visible == ("4",)


def test_one_gpu_is_shared_by_an_embedded_server_and_the_trainer():
    p = plan_placement(cfg("train.weight_sync=broadcast"), gpus=("0",))
    assert p.server_visible == ("0",) and p.trainer_visible == ("0",) and p.shared == ("0",)


def test_explicit_devices_are_kept_and_checked():
    p = plan_placement(cfg("server.device=cpu", "train.device=cpu"), gpus=GPUS8)
    assert p.server_visible == (None,) and p.server_devices == ("cpu",) and p.trainer_visible == (None,)
    p = plan_placement(cfg("server.device=cuda:5", "train.cuda_visible_devices='1,2'", "train.nproc=2"), gpus=GPUS8)
    assert p.servers == ((5,),) and p.server_devices == ("cuda:5",) and p.server_visible == (None,)
    assert p.trainer_visible == ("1,2",)


@pytest.mark.parametrize(
    "overrides,gpus,key",
    [
        (["server.num_servers=2", "server.device=cuda:1"], GPUS8, "server.device"),
        (["server.num_servers=3", "server.base_gpu_id=6"], GPUS8, "server.base_gpu_id"),
        (["train.nproc=3"], ("0", "1"), "train.nproc"),
        (["train.nproc=2", "train.cuda_visible_devices='3'"], GPUS8, "train.cuda_visible_devices"),
        (["train.cuda_visible_devices='3,3'"], GPUS8, "train.cuda_visible_devices"),
        (["train.nnodes=2", "train.nproc=2", "train.cuda_visible_devices='0,1'"], GPUS8, "train.cuda_visible_devices"),
        (
            ["server.backend=sglang", "server.num_servers=2", "server.extra_args=[--base-gpu-id, '3']"],
            GPUS8,
            "server.extra_args",
        ),
        (
            ["server.backend=sglang", "server.gpus_per_server=2", "server.extra_args=['--tp-size=4']"],
            GPUS8,
            "server.extra_args",
        ),
        (
            ["server.backend=sglang", "train.weight_sync=broadcast", "server.extra_args=[--dp-size, '2']"],
            GPUS8,
            "server.extra_args",
        ),
        (
            ["server.backend=sglang", "train.weight_sync=broadcast", "server.extra_args=[--pp-size, '2']"],
            GPUS8,
            "server.extra_args",
        ),
        (["server.backend=sglang", "server.num_servers=4", "server.gpus_per_server=2"], GPUS8, "train.nproc"),
        (
            ["server.backend=sglang", "train.cuda_visible_devices='0'", "train.weight_sync=broadcast"],
            GPUS8,
            "train.cuda_visible_devices",
        ),
        (["server.backend=sglang", "train.cuda_visible_devices='0'"], GPUS8, "server.extra_args"),
    ],
)
def test_layouts_that_cannot_work_are_refused_naming_the_key(overrides, gpus, key):
    with pytest.raises(ConfigError) as e:
        plan_placement(cfg(*overrides), gpus=gpus)
    assert str(e.value).startswith(key), str(e.value)


def test_sglang_layouts_that_work():
    # tensor parallelism: 2 servers x tp 2, trainers after them
    p = plan_placement(
        cfg(
            "server.backend=sglang",
            "server.num_servers=2",
            "server.gpus_per_server=2",
            "train.nproc=4",
            "train.weight_sync=broadcast",
        ),
        gpus=GPUS8,
    )
    assert p.servers == ((0, 1), (2, 3)) and p.trainer_visible == ("4,5,6,7",) and p.shared == ()
    # data parallelism takes tp x dp GPUs (disk sync); with DP attention the broadcast is allowed
    p = plan_placement(
        cfg("server.backend=sglang", "server.gpus_per_server=2", "server.extra_args=[--dp-size, '2']"), gpus=GPUS8
    )
    assert p.servers == ((0, 1, 2, 3),) and p.trainer_visible == ("4",)
    plan_placement(
        cfg(
            "server.backend=sglang",
            "train.weight_sync=broadcast",
            "server.extra_args=[--dp-size, '2', --enable-dp-attention]",
        ),
        gpus=GPUS8,
    )
    # sharing a GPU with SGLang: only with disk sync and a memory fraction set
    p = plan_placement(
        cfg(
            "server.backend=sglang",
            "train.cuda_visible_devices='0'",
            "server.extra_args=[--mem-fraction-static, '0.4']",
        ),
        gpus=GPUS8,
    )
    assert p.shared == ("0",)


def test_several_local_agents_get_slices():
    p = plan_placement(cfg("train.nnodes=2", "train.nproc=2"), gpus=GPUS8)
    assert p.servers == ((0,),) and p.trainer_visible == ("1,2", "3,4")
    p = plan_placement(cfg("train.nnodes=2", "train.nproc=1", "train.cuda_visible_devices='6,7'"), gpus=GPUS8)
    assert p.trainer_visible == ("6", "7")


def test_slurm_places_nothing_but_checks_the_arguments():
    assert plan_placement(cfg("launcher=slurm", "server.num_servers=4"), gpus=GPUS8).trainer_visible == (None,)
    with pytest.raises(ConfigError, match="^server.extra_args"):
        plan_placement(
            cfg(
                "launcher=slurm", "server.backend=sglang", "train.weight_sync=broadcast", "server.extra_args=['--dp=2']"
            ),
            gpus=GPUS8,
        )


def test_sglang_command_carries_tp_size_and_base_gpu_id(tmp_path):
    args = ["--mem-fraction-static", "0.5"]
    cmd = sglang_server_cmd(  # a GPU host's command (device=cuda: on a CPU, SGLang's CPU engine takes no GPU id)
        "/m", host="127.0.0.1", port="30000", api_key=None, extra_args=args, base_gpu_id=4, tp_size=2, device="cuda"
    )
    assert sglang_flag(cmd, "--tp-size") == "2" and sglang_flag(cmd, "--base-gpu-id") == "4"
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    one = sglang_server_cmd("/m", host="h", port="1", api_key=None, extra_args=[], tp_size=1, device="cuda")
    assert sglang_flag(one, "--tp-size") is None
    given = sglang_server_cmd("/m", host="h", port="1", api_key=None, extra_args=["--tp=2"], tp_size=2)
    assert given.count("--tp-size") == 0 and "--tp=2" in given  # not passed twice
    # the launcher: server i's base GPU is base_gpu_id + i * gpus_per_server, and its tp size goes with it
    procs = Processes(str(tmp_path))
    child = procs.start_sglang_server(
        1, "/nonexistent", host="127.0.0.1", port=0, api_key=None, extra_args=[], base_gpu_id=2, gpus_per_server=2,
        device="cuda",
    )  # fmt: skip
    procs.shutdown(grace_s=5)
    logged = shlex.split(open(child.log_path).readline()[2:])
    assert sglang_flag(logged, "--base-gpu-id") == "4" and sglang_flag(logged, "--tp-size") == "2"


# ---- the broadcast group: ranks and backend ------------------------------------------------------------------


def test_ranks_come_from_sglang_server_info():
    assert server_ranks("u", {"tp_size": 4, "dp_size": 1, "pp_size": 1}, default=1) == 4
    assert server_ranks("u", None, default=2) == 2  # no answer: the config's gpus_per_server
    assert server_ranks("u", {"tp_size": 8, "dp_size": 4, "enable_dp_attention": True}, default=1) == 8
    with pytest.raises(BroadcastLayoutError, match="dp_size=2"):
        server_ranks("u", {"tp_size": 1, "dp_size": 2, "enable_dp_attention": False}, default=1)
    with pytest.raises(BroadcastLayoutError, match="pp_size=2"):
        server_ranks("u", {"tp_size": 1, "pp_size": 2}, default=1)


def test_gloo_when_a_member_shares_a_gpu():
    assert group_backend("nccl", "GPU-a", ["GPU-b", "GPU-c"]) == ("nccl", "")
    assert group_backend("nccl", "GPU-a", ["GPU-a"])[0] == "gloo"
    assert group_backend("nccl", "GPU-a", ["GPU-b", "GPU-b"])[0] == "gloo"
    assert group_backend("nccl", "GPU-a", ["", ""]) == ("nccl", "")  # SGLang reports none: placement decided
    assert group_backend("gloo", "", ["x"]) == ("gloo", "")


class _Info:
    gpu_uuid = "GPU-1"


class _Client:
    def __init__(self, infos):
        self.infos = infos

    async def server_info(self, urls):
        return {u: self.infos[u] for u in urls}


async def test_plan_group_counts_each_servers_tp_ranks():
    infos = {
        "http://a": {"tp_size": 2, "dp_size": 1, "gpu_uuid": ""},
        "http://b": ConnectionError("down"),
        "http://c": {"tp_size": 4},
    }
    plan = await plan_group(
        _Client(infos), ["http://a", "http://b", "http://c"], _Info(), default_ranks=1, backend="nccl"
    )
    assert plan.ranks == [2, 1, 4] and plan.num_server_ranks == 7 and plan.backend == "nccl"
    shared = {"http://a": {"tp_size": 1, "gpu_uuid": "GPU-1"}}
    plan = await plan_group(_Client(shared), ["http://a"], _Info(), default_ranks=1, backend="nccl")
    assert plan.backend == "gloo" and "GPU-1" in plan.reason


async def test_embedded_server_reports_its_layout_and_destroys_groups(tiny_ckpt):
    """The embedded server answers /get_server_info with SGLang's parallelism fields (one rank), and serves
    /destroy_weights_update_group with SGLang's answers: 400 "does not exist" for an unknown group."""
    import aiohttp

    from areal_async.inference.client import InferenceClient
    from areal_async.server.app import start_server

    async with (
        await start_server(tiny_ckpt, port=0, device="cpu", max_total_tokens=2048) as server,
        InferenceClient([server.url]) as client,
    ):
        info = (await client.server_info())[server.url]
        assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 1, 1) and info["gpu_uuid"] == ""
        plan = await plan_group(client, [server.url], _Info(), default_ranks=3, backend="gloo")
        assert plan.ranks == [1]
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url + "/destroy_weights_update_group", json={"group_name": "nope"}) as r:
                assert r.status == 400
                body = await r.json()
        assert body == {"success": False, "message": "The group to be destroyed does not exist."}
        assert await client.destroy_weights_update_group("nope", [server.url]) == {server.url: None}
