"""A multi-node trainer job across two real hosts (network namespaces, areal_async/testing/hosts.py): torchrun agent 0
on h0 serves the c10d rendezvous, agent 1 on h1 joins it by h0's host name, and each rank reports its address to a
registry on a third host (this test process, on the bridge). Nothing reaches anything at 127.0.0.1: each host's
loopback is its own. The job must train to the same numbers as two processes on one host fed the same batches, and
an embedded server on h2 takes its weights by torch.distributed broadcast from trainer rank 0 on h0 and from disk
(the published checkpoint, on the filesystem the hosts share), ending with equal logprobs. Every address a part
advertises must be its host's routable one, and no port another host must reach may listen on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import random
import secrets

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from areal_async.config import load_config
from areal_async.launch.processes import Processes, c10d_args, embedded_server_cmd, thread_env, trainer_cmd
from areal_async.net.rank_registry import Registry
from areal_async.testing import hosts as nshosts
from areal_async.train.client import TrainerGroup
from areal_async.types import Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ON_LOOP = pytest.mark.asyncio(loop_scope="module")

TRAIN = [
    "train.ppo_minibatches=2",
    "train.micro_batch_tokens=48",
    "train.advantage.batch_norm=true",
    "train.optim.lr=1e-3",
    "train.loss.behav_imp_weight_cap=null",
    "train.device=cpu",
]
STATS = ("loss", "pg_loss", "grad_norm", "clip_frac", "approx_kl", "entropy", "tokens", "num_seqs", "optimizer_steps")
PROBES = [[3, 17, 42, 8, 64, 23, 5, 90, 31], [50, 2, 77, 13, 13, 60]]
RDZV_PORT, SERVER_PORT = 29400, 30000  # a fresh namespace has every port free


def batch(rng: random.Random, version: int) -> list[Trajectory]:
    """Four groups of uneven lengths, so that the two ranks train on different shards."""
    out = []
    for g in range(4):
        for _ in range(3):
            p, r = rng.randrange(3, 8), rng.randrange(4, 20)
            out.append(
                Trajectory(
                    input_ids=[rng.randrange(2, 100) for _ in range(p + r)],
                    loss_mask=[0] * p + [1] * r,
                    logprobs=[0.0] * p + [-4.5 + rng.gauss(0, 0.3) for _ in range(r)],
                    versions=[-1] * p + [version] * r,
                    reward=float(rng.randrange(3)),
                    group_id=g,
                    prompt_len=p,
                )
            )
    return out


def listeners(host: nshosts.Host) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening on `host`, IPv4 and IPv6 (its own /proc/net/tcp*, read from
    inside it); an IPv4-mapped IPv6 address is given as the IPv4 one."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        p = host.run(["cat", table], capture_output=True, text=True, check=True)
        for line in p.stdout.splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # TCP_LISTEN
                continue
            ip_hex, port_hex = local.split(":")
            raw = b"".join(bytes.fromhex(ip_hex[i : i + 8])[::-1] for i in range(0, len(ip_hex), 8))
            ip = ipaddress.ip_address(raw)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
                ip = ip.ipv4_mapped
            out.add((str(ip), int(port_hex, 16)))
    return out


def load_weights(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))


async def logprobs(url: str, key: str) -> list[list[float]]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        for ids in PROBES:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
            async with s.post(url + "/generate", json=body | {"logprob_start_len": 0}) as r:
                assert r.status == 200, await r.text()
                out.append([x[0] for x in (await r.json())["meta_info"]["input_token_logprobs"][1:]])
    return out


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


async def watch_both(*procs: Processes) -> None:
    """Raise ChildFailed (with the log tail) when a child of either set exits."""
    await asyncio.gather(*(p.watch() for p in procs))


@pytest.fixture(scope="module")
def hosts():
    why = nshosts.skip_reason()
    if why:
        pytest.skip(why)
    made = nshosts.Hosts(3, loopback_name=True)  # Debian-style: each name is 127.0.1.1 on its own host
    yield made
    made.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def jobs(hosts, tiny_ckpt, tmp_path_factory):
    """The two-node job (h0 + h1, registry here), the one-host job of two ranks, and the server on h2."""
    from areal_async.inference.client import InferenceClient

    root = tmp_path_factory.mktemp("netns")
    cfg = load_config(None, [f"model.path={tiny_ckpt}", f"run_dir={root}", *TRAIN])
    config_json = msgspec.json.encode(cfg.train).decode()
    secret, key = os.urandom(32), secrets.token_hex(16)
    two = Processes(str(root / "two"))
    one = Processes(str(root / "one"))
    registry = Registry(secret, two.run_dir)
    groups: list[TrainerGroup] = []
    client = None
    try:
        await registry.start(hosts.gateway_address)  # only the bridge: the hosts reach it, nothing else must
        env = {**thread_env(1), "AREAL_RPC_SECRET": secret.hex(), **registry.env()}
        rdzv = c10d_args(nnodes=2, endpoint=f"{hosts[0].name}:{RDZV_PORT}", run_id=secrets.token_hex(4), timeout_s=60)
        common = dict(model=tiny_ckpt, nproc=1, config_json=config_json, seed=cfg.seed, torchrun_args=rdzv)
        for node in (0, 1):
            cmd = trainer_cmd(**common, run_dir=two.run_dir, rpc_host="0.0.0.0")
            two.spawn(f"trainer{node}", hosts[node].argv(cmd), env, role="trainer")
        one.start_trainers(
            model=tiny_ckpt, nproc=2, config_json=config_json, seed=cfg.seed, secret_hex=secret.hex(), torch_threads=1
        )
        server_cmd = embedded_server_cmd(
            tiny_ckpt,
            host="0.0.0.0",
            port=str(SERVER_PORT),
            device="cpu",
            max_total_tokens=4096,
            max_running_requests=8,
            api_key=key,
        )
        two.spawn("server0", hosts[2].argv(server_cmd), thread_env(1), role="server")
        url = f"http://{hosts[2].address}:{SERVER_PORT}"
        watch = asyncio.ensure_future(watch_both(two, one))
        connect = asyncio.ensure_future(
            asyncio.gather(
                TrainerGroup.connect(two.run_dir, 2, secret, timeout=180),
                TrainerGroup.connect(one.run_dir, 2, secret, timeout=180),
                two.wait_healthy([url], 120, key),
            )
        )
        await asyncio.wait([watch, connect], return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        if not connect.done():
            connect.cancel()
            watch.result()  # ChildFailed, with the log tail
        group_two, group_one, _ = connect.result()
        groups += [group_two, group_one]
        client = InferenceClient([url], api_key=key)
        yield {"two": group_two, "one": group_one, "client": client, "url": url, "key": key, "root": root} | {
            "registry": registry
        }
    finally:
        for g in groups:
            try:
                await asyncio.wait_for(g.shutdown(), 60)
            except Exception:
                pass
        if client is not None:
            await client.close()
        await asyncio.gather(asyncio.to_thread(two.shutdown), asyncio.to_thread(one.shutdown))
        await registry.close()


@ON_LOOP
async def test_ranks_on_two_hosts_advertise_routable_addresses(hosts, jobs):
    infos = await jobs["two"].info()
    assert [(i.rank, i.world_size) for i in infos] == [(0, 2), (1, 2)]
    regs = jobs["registry"].entries
    assert sorted(regs) == ["rank0", "rank1"]
    for r in (0, 1):
        assert regs[f"rank{r}"].node == hosts[r].name  # each rank runs on its own host
        assert regs[f"rank{r}"].address.startswith(f"tcp://{hosts[r].address}:")
        assert infos[r].host == hosts[r].address  # what the servers' broadcast rendezvous dials
    # every port a rank or the server told anyone about listens on the host's address or all of them, never
    # only on loopback; and nothing else on these hosts listens on loopback that another host would need
    advertised = {(hosts[r].address, int(regs[f"rank{r}"].address.rsplit(":", 1)[1])) for r in (0, 1)}
    advertised |= {(hosts[0].address, RDZV_PORT), (hosts[2].address, SERVER_PORT)}
    for host in hosts.hosts:
        bound = listeners(host)
        ports = {port for ip, port in bound if not ipaddress.ip_address(ip).is_loopback}
        for addr, port in advertised:
            if addr == host.address:
                assert port in ports, (host.name, port, sorted(bound))
        loopback = sorted(port for ip, port in bound if ipaddress.ip_address(ip).is_loopback)
        assert not loopback, f"{host.name} listens on loopback: {loopback}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trained(jobs):
    """Two steps of both jobs on the same batches: each step's results and published checkpoint."""
    rng = random.Random(5)
    results: dict[str, list] = {"two": [], "one": []}
    published: dict[str, list[str]] = {"two": [], "one": []}
    for step in range(2):
        b = batch(rng, step)
        for name in ("two", "one"):
            results[name].append(await jobs[name].train_step(b, step))
            pub = await jobs[name].publish(step + 1, str(jobs["root"] / f"pub_{name}"), keep=4)
            published[name].append(pub.path)
    return results, published


@ON_LOOP
async def test_two_hosts_train_as_one_host_of_two_processes(trained):
    results, published = trained
    for step in range(2):
        res = {name: results[name][step] for name in ("two", "one")}
        assert res["two"].version == res["one"].version == step + 1
        for k in STATS:
            assert res["two"].stats[k] == pytest.approx(res["one"].stats[k], abs=1e-6), (step, k)
        wa, wb = (load_weights(published[n][step]) for n in ("two", "one"))
        assert set(wa) == set(wb)
        assert max(float(np.abs(wa[k] - wb[k]).max()) for k in wa) < 1e-6, step
    w1, w2 = (load_weights(p) for p in published["two"])
    assert max(float(np.abs(w1[k] - w2[k]).max()) for k in w1) > 1e-4  # the steps moved the weights


@ON_LOOP
async def test_server_on_a_third_host_takes_broadcast_and_disk_weights(jobs, trained):
    two, client, where = jobs["two"], jobs["client"], (jobs["url"], jobs["key"])
    before = await logprobs(*where)
    await two.init_broadcast_group(client, num_server_ranks=1, backend="gloo")  # at rank 0's reported address
    await two.broadcast_weights(client, two.version, bucket_bytes=64 << 10)
    by_broadcast = await logprobs(*where)
    await client.update_weights_from_disk(trained[1]["two"][-1], two.version)  # the path the hosts share
    by_disk = await logprobs(*where)
    assert gap(before, by_disk) > 1e-3  # the trained weights differ from the initial ones
    assert gap(by_broadcast, by_disk) < 1e-6
