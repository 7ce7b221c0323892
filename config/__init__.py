"""mcorekit.config: the experiment and cluster-profile schemas, and every rule an experiment must follow."""
