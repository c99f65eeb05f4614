"""All per-request memory of one model, sized from one budget.

- `specs`: every pool states what one token, slot or snapshot of it costs and allocates itself.
- `manager`: `MemoryPlan` splits the budget between the pools; `CacheManager` owns them, the request
  table and the page, slot and snapshot ids, and is what the engine and the batch reach the caches by.
- `pages`: free lists, reference-counted token pages (`SharedPages`), the request-to-token table.
- `kv`: the DSA layers' per-token caches (MLA latent, indexer keys); `state`: KDA state slots.
- `prefix_cache`: the tree of cached pages with KDA snapshots; it holds references on the manager's
  pages and takes snapshot ids from it, and never sees the manager itself.

Layer: below `forward_batch` and the layers, beside `sampling` (see `hylo`'s docstring); imports
`config` and `host_copy` only.
"""
