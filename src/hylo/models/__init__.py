"""Whole models and their checkpoints: `glm5_next` (the target model, and which kernels refuse a
model's config), `mtp` (its next-n layer), `dflash` (DFlash/DFlash2 drafts), `loader` (checkpoint
I/O: safetensors, FP8, each rank's shard; `build_model` / `build_mtp_layer` build without reading),
`random_init` and `demo` (random and embedded demo weights).

Layer: below `speculative`, above `layers` (see `hylo`'s docstring).
"""
