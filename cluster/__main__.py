"""``python -m cluster rl job.yaml``: the ``rayrl`` command from a checkout (see cluster/cli.py)."""
from cluster.cli import main

main()
