"""Environment variables that `mpickpt-run`, the node agents and the trainers pass each other and
that the agents read before anything heavy is imported (no torch here). Local constants."""

STORE_VARIABLE = "MPICKPT_STORE"
"""host:port of the run's rendezvous store, hosted outside the trainers (by `mpickpt-run`)."""
AGENTS_VARIABLE = "MPICKPT_AGENTS"
"""host:port of the run's agent watch (`mpickpt.launch.run_store.AgentWatch`)."""
RESTART_VARIABLE = "MPICKPT_RESTART"
"""Set by `mpickpt-run` for every run it starts (and so seen by the agents and trainers): how
many relaunches came before."""
