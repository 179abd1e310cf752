"""Usage records: one per served request, spooled on disk and shipped to the control plane."""
