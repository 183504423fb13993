"""How a job is launched and relaunched: launch checks (N singletons), the `mpickpt-run` relaunch
loop for mpiexec and srun, and the cleanup of a dead step's MPICH shared memory."""
