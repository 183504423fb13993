"""Environment variables that `mpickpt-run`, the node agents and the trainers pass each other and
that the agents read before anything heavy is imported (no torch here). Local constants."""

STORE_VARIABLE = "MPICKPT_STORE"
"""host:port of the run's rendezvous store, hosted outside the trainers (by `mpickpt-run`)."""
AGENTS_VARIABLE = "MPICKPT_AGENTS"
"""host:port of the run's agent watch (`mpickpt.launch.run_store.AgentWatch`)."""
RESTART_VARIABLE = "MPICKPT_RESTART"
"""Set by `mpickpt-run` for every run it starts (and so seen by the agents and trainers): how
many relaunches came before."""


def relaunches(environ) -> list[str]:
    """The variables that say this launch is a relaunch of the same command (`mpickpt-run`'s
    restarts, a requeued Slurm job), as NAME=VALUE; empty on a job's first launch. Local."""
    counts = {name: environ.get(name, "").strip() for name in (RESTART_VARIABLE,
                                                                "SLURM_RESTART_COUNT")}
    return [f"{name}={value}" for name, value in counts.items()
            if value.isdigit() and int(value) > 0]
