"""Running one forward of the model over the paged KV pool: the pool and its memory (`kv_pool`, `kv_memory`,
`host_memory`), the model runner, token sampling (`sampler`), the half-precision weight copy and when the
weight-derived state is stale (`weight_copy`, `weight_state`), autocast and eval-mode helpers."""
