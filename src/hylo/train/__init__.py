"""Training hylo's embedded demo model and speculative drafts (`hylo train`, `hylo train-draft`)."""
