"""Training hylo's embedded demo model and speculative drafts (`hylo train`, `hylo train-draft`).

Layer: beside `engine`, above `speculative` and `models` (see `hylo`'s docstring).
"""
