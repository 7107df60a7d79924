"""The cluster side, in rooms whose imports only go down (architecture section 2):

* ``jobs`` - the command line, the config records and every check of a job, the RL and SFT jobs;
* ``ray_wing`` - placement, worker groups, the role handles, the Ray backend;
* ``local`` - the local backend (one process, plain torch);
* ``loop`` - the backend protocol and the loops over it (``train``, ``train_sft``, ``evaluate``).
"""
import time

IMPORTED_AT = time.time()  # the process start where /proc is absent (cluster.jobs.outputs.process_start_time)
