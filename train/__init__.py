"""mcorekit.train: the Megatron-Core training entry (python -m mcorekit.train)."""
