"""mcorekit: Megatron-Core on Slurm, from an experiment file to a served model."""

__version__ = "0.1.0"
