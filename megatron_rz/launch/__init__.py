"""Where and how a run starts: run directories, process settings, SLURM cluster, planner, submit, preemption."""
