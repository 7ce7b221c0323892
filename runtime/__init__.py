"""mcorekit.runtime: what runs inside a job on every rank, whoever started it: the rank environment (env.py) and
surviving time limits by requeue (requeue.py). Its own part so that train/ and the launcher's smoke payload share
it without train/ depending on the launcher (submitit, sbatch rendering) that only the login node needs."""
