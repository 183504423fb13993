"""A discrete-event Monte Carlo of a synchronous training job under failures (`python -m
mpickpt.simulate`): per-node failure processes, multi-node failures, time limits and preemption,
and each of mpickpt's fault-tolerance strategies, with per-event costs from `mpickpt.costmodel`."""
