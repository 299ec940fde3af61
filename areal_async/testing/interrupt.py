"""A test helper: swap weights while generation is demonstrably in flight."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec


async def swap_weights_mid_generation(
    server_url: str, client, new_ckpt: str, version: int, *, max_new_tokens: int, after_tokens: int = 20
) -> None:
    """Run a streaming probe request on the server (it is batched with whatever else runs there); once it has made
    `after_tokens` tokens, pause(abort) every server, load `new_ckpt` as `version`, and continue. So the other
    requests in flight are interrupted part-way, not before they start or after they end."""
    seen = [0]

    async def progress() -> None:
        body = {
            "input_ids": [9, 10, 11],
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        }
        async with aiohttp.ClientSession() as s, s.post(server_url + "/generate", data=msgspec.json.encode(body)) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    seen[0] = msgspec.json.decode(line[6:])["meta_info"]["completion_tokens"]

    observer = asyncio.create_task(progress())
    for _ in range(4000):
        if seen[0] >= after_tokens:
            break
        await asyncio.sleep(0.005)
    await client.pause()
    await observer
    await client.update_weights_from_disk(new_ckpt, version)
    await client.resume()
