"""The model's layers as `nn.Module`s over hylo's ops: `kda` (linear attention), `sparse_mla` and
`indexer` (DSA attention over the rows the indexer picks), `moe` and `mlp`, `mhc` (hyper-connections),
`linear` (projections, bf16 or FP8), `vocab` (vocabulary-parallel embedding and head), `norm`. Each
layer holds this rank's share (`hylo.parallel.layout.Parallel`) and reads its caches through the
`ForwardBatch`; none knows the engine or a request.

Layer: below `models`, above `parallel`, `forward_batch` and `ops` (see `hylo`'s docstring).
"""
