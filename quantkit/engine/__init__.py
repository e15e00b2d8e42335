"""The serving engine: continuous batching over a paged KV cache with prefix caching.

Modules: `blocks` (block allocator, prefix keys), `kv_pool` (the pool's tensors), `sequence` (a
request in the engine), `scheduler` (which tokens each step computes), `attention` (attention over
the pool), `runner` (one model step), `metrics`, `engine` (the step loop), `loop` (the engine on
its own thread, for the server).
"""
