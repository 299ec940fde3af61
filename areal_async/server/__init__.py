"""The embedded SGLang-protocol inference server (a torch process): HTTP app, engine, scheduler, paged KV cache,
model, sampling, weight loading, and the C kernels in `kernels/`. `python -m areal_async.server` starts one."""
