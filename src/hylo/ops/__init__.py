"""Op families (one folder each: torch reference, Triton kernels, one dispatcher); `dispatch.py` is
the rule every dispatcher follows."""
