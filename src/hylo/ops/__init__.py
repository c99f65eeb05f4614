"""Op families (one folder each: torch reference, Triton kernels, one dispatcher); `dispatch.py` is
the rule every dispatcher follows. The families import `dispatch.use_kernel`; dispatch imports none of
them (what a whole model's config makes a kernel refuse is asked in `hylo.models.glm5_next`).

Layer: the bottom, beside `config`, `tokenizer` and `host_copy` (see `hylo`'s docstring).
"""
