"""Training hylo's embedded demo model and speculative drafts (`hylo train`, `hylo train-draft`).

Layer: beside `engine`, above `speculative` and `models` (see `hylo`'s docstring). Importing the
package imports no torch: the command lines build their parsers from what is here.
"""

# what `hylo train-draft --algorithm` trains (`train.draft.train_draft`)
DRAFT_ALGORITHMS = ("dflash", "dflash2", "mtp")
