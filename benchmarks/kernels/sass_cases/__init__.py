"""One module a kernel family for `sass.py`: each defines `MODULES` (the family's modules whose kernels
launch as programmatic dependents on Hopper) and `CASES` (a name for each call whose launches are
fingerprinted; each call makes its launches with CPU tensors)."""
