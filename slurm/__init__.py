"""mcorekit.slurm"""
