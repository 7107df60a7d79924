"""``python -m cluster rl job.yaml``: the ``rayrl`` command from a checkout (see cluster/jobs/cli.py)."""
from cluster.jobs.cli import main

main()
