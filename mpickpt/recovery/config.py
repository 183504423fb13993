"""RecoveryConfig: how lost shards are recovered and what the interval models assume (the
`recovery` flags)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mpickpt.durations import Duration
from mpickpt.job_variables import RESTART_VARIABLE
from mpickpt.launch.rank_wrapper import AGENT_VARIABLE, IN_PLACE_VARIABLE
from mpickpt.options import int_at_least, option, positive_float

MODES = ("full", "partial", "parity", "auto")
DEFAULT_TARGET_PLS = 0.1
"""CPR §4.1: 'a rough, conservative value (e.g., 0.1) works reasonably well across many setups'."""


def _pls(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise ValueError(f"--target-pls must lie in (0, 1), got {text!r}")
    return value


def _duration(flag: str):
    def parse(text: str) -> Duration:
        return Duration.parse(text, flag)
    return parse


def _reschedule(text: str) -> Duration:
    if str(text).strip() in ("0", "0s", "0steps"):
        return Duration(0.0)
    return Duration.parse(text, "--reschedule-time")


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoveryConfig:
    """What a loss of embedding shards costs and how it is recovered (CPR, ECRM)."""

    OPTION_GROUP: ClassVar[str] = "recovery"

    mode: str | None = option(None, flag="--recovery", choices=MODES)
    """full: every rank rolls back to the latest checkpoint; partial (CPR): only the lost shards
    reload theirs while the rest, the dense part and the reader go on; parity (ECRM): rebuild from
    parity, full rollback where parity cannot; auto: parity where it covers the loss, else CPR's
    benefit check between partial and full (default: parity with --parity-k, else full)"""
    target_pls: float | None = option(None, parse=_pls, metavar="P")
    """target portion of lost samples for partial recovery: sets the checkpoint interval to
    2 P T_fail / L (CPR eq. 4; L = share of the shards a failure loses)"""
    mtbf: Duration | None = option(None, parse=_duration("--mtbf"), metavar="T")
    """mean time between failures of the job (per job, not per node): 300 or 300steps, 14h,
    90s (default: the mean of --failure-model)"""
    reschedule: Duration = option(Duration(0.0), flag="--reschedule-time",
                                  parse=_reschedule, metavar="T")
    """time to replace the failed nodes (O_res of CPR eq. 1 and 2), counted in the overhead
    models, not slept"""
    survivor_dumps: str = option("auto", choices=("auto", "off", "shm", "ckpt"))
    """when a peer dies, the survivors dump their state at their last completed step to node-local
    shared memory (shm), or also to the checkpoint directory (ckpt, for a relaunch on other
    nodes); the relaunch restores them from it and recovers only the dead rank (--recovery);
    auto: shm under mpickpt-run with --ckpt-dir (which relaunches from them), else off"""
    peer_timeout: float = option(10.0, parse=positive_float, metavar="S")
    """seconds of silence after which a peer's node counts as dead (a killed process is seen
    at once)"""
    in_place: str = option("auto", choices=("auto", "on", "off"))
    """on: when a peer dies, the survivors keep their processes and a respawned process takes
    the dead rank's place in a new generation of the job (needs mpickpt-run under MPICH's
    mpiexec, whose rank agents respawn); off: survivors exit for a relaunch; auto: on where the
    rank has such an agent, else off"""
    spares: int = option(0, parse=int_at_least(0), metavar="S")
    """hot spares: the last S processes of the launch train nothing until a rank dies, then one
    takes its place in place (faster than a respawn, and it outlives the loss of the dead rank's
    node); mpickpt-run -n N launches N + S processes. Needs in-place recovery"""
    warm_respawn: bool = option(False, switch=True)
    """each node agent keeps a warm standby process (imported and warmed up, waiting) that
    takes its trainer's place at once when the trainer is killed, instead of a process
    started after the death (seconds of Python and torch start); one idle process per rank.
    Needs in-place recovery"""
    startup_timeout: float = option(300.0, parse=positive_float, metavar="S")
    """seconds from a trainer's start to its first step (MPI_Init, the groups, the model, the
    restore) before it gives up on a peer that never came and exits 77 for a relaunch"""
    join_timeout: float = option(60.0, parse=positive_float, metavar="S")
    """seconds the members of a new generation wait for each other (the replacement included)
    before the in-place recovery gives up and the job falls back to a relaunch"""

    def __post_init__(self):
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"--recovery must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.target_pls is not None and not 0.0 < self.target_pls < 1.0:
            raise ValueError(f"--target-pls must lie in (0, 1), got {self.target_pls!r}")

    def dumps_mode(self, environ, has_checkpoints: bool) -> str:
        """The survivor dumps in force: as given, or for auto shm when a relaunch loop that
        restores them (mpickpt-run, which sets MPICKPT_RESTART) runs the job and it writes
        checkpoints, else off. Local."""
        if self.survivor_dumps != "auto":
            return self.survivor_dumps
        return "shm" if has_checkpoints and RESTART_VARIABLE in environ else "off"

    def dumps_note(self, environ) -> str | None:
        """What to say at the start when survivor dumps were asked for outside a relaunch loop
        (no mpickpt-run): they are written, but a launcher may kill the survivors with the dead
        rank before they dump (MPICH's hydra SIGKILLs them), and nothing restores them unless
        the same command is run again on the same nodes. None otherwise. Local."""
        if self.survivor_dumps in ("auto", "off") or RESTART_VARIABLE in environ:
            return None
        return (f"--survivor-dumps {self.survivor_dumps} without mpickpt-run: the launcher may "
                f"kill the survivors with a dead rank before they dump (MPICH's mpiexec does), "
                f"and only running the same command again restores the dumps; mpickpt-run "
                f"keeps the survivors alive and relaunches")

    def in_place_wanted(self, environ) -> bool:
        """Whether a death is recovered in place: on or auto, and this rank runs under a node
        agent that respawns (mpickpt-run under hydra sets MPICKPT_IN_PLACE=1 for it). Local."""
        return self.in_place != "off" and _respawning_agent(environ)

    def check_launcher(self, environ, processes: int | None = None) -> None:
        """`--in-place on` and `--spares` need a node agent that respawns; spares must leave a
        rank to train among the launch's `processes` (ValueError naming the fix). Local."""
        if self.in_place == "on" and not _respawning_agent(environ):
            raise ValueError("--in-place on needs the node agents that mpickpt-run starts "
                             f"({AGENT_LAUNCHERS}; this rank has none: a launch without "
                             "mpickpt-run); run under mpickpt-run, or use --in-place auto or off")
        if self.warm_respawn and (self.in_place == "off" or not _respawning_agent(environ)):
            raise ValueError("--warm-respawn keeps a standby for the node agent's respawn in "
                             "place; it needs in-place recovery under mpickpt-run's agents, not "
                             + ("--in-place off" if self.in_place == "off" else
                                f"a launch without them (they run under {AGENT_LAUNCHERS})"))
        if not self.spares:
            return
        if self.in_place == "off":
            raise ValueError(f"--spares {self.spares} takes a dead rank's place in place; it "
                             f"needs in-place recovery, not --in-place off")
        if not _respawning_agent(environ):
            raise ValueError(f"--spares {self.spares} needs in-place recovery, which needs the "
                             f"node agents that mpickpt-run starts ({AGENT_LAUNCHERS}; this rank "
                             f"has none); run under mpickpt-run -n N, which launches N + "
                             f"{self.spares} processes (under srun: allocate N + "
                             f"{self.spares} tasks)")
        if processes is not None and self.spares >= processes:
            raise ValueError(f"--spares {self.spares} leaves no rank to train among the "
                             f"launch's {processes} processes: the spares are the last "
                             f"{self.spares}, so launch more (mpickpt-run -n N adds them)")

    def resolved_mode(self, parity: bool) -> str:
        """The mode in force: as given, else parity with parity on, else full. Local."""
        return self.mode or ("parity" if parity else "full")

    @property
    def pls_target(self) -> float:
        return self.target_pls if self.target_pls is not None else DEFAULT_TARGET_PLS


AGENT_LAUNCHERS = "MPICH's mpiexec, Open MPI 4's mpirun, srun"
"""The launchers under which mpickpt-run starts respawning node agents (refusals name them)."""


def _respawning_agent(environ) -> bool:
    """This rank runs under a node agent that respawns a dead trainer (mpickpt-run sets
    MPICKPT_IN_PLACE=1 for it under the AGENT_LAUNCHERS)."""
    return bool(environ.get(AGENT_VARIABLE)) and environ.get(IN_PLACE_VARIABLE) == "1"


def check_combination(rec: RecoveryConfig, checkpoint, parity, faults) -> None:
    """Flags that only make sense together, checked before training; ValueError naming them.
    Local."""
    mode = rec.resolved_mode(parity is not None)
    if checkpoint is None:
        for given, what in ((rec.mode == "partial", "--recovery partial"),
                            (rec.mode == "auto", "--recovery auto"),
                            (rec.target_pls is not None, "--target-pls")):
            if given:
                raise ValueError(f"{what} needs --ckpt-dir: the lost shards reload from the "
                                 f"latest checkpoint")
    if rec.survivor_dumps not in ("off", "auto") and checkpoint is None:
        raise ValueError(f"--survivor-dumps {rec.survivor_dumps} needs --ckpt-dir: the dumps "
                         f"belong to the job that writes there")
    if rec.mode == "parity" and parity is None:
        raise ValueError("--recovery parity needs --parity-k (in-memory parity to rebuild from)")
    if rec.target_pls is not None and mode not in ("partial", "auto"):
        raise ValueError(f"--target-pls sets the interval of partial recovery; it needs "
                         f"--recovery partial or auto, not {mode}")
    fixed = checkpoint.fixed_interval if checkpoint is not None else None
    if rec.target_pls is not None and fixed is not None:
        raise ValueError(f"--target-pls sets the checkpoint interval (CPR eq. 4); drop "
                         f"--ckpt-interval {fixed} (or set it to auto)")
    planned = (checkpoint is not None and checkpoint.auto_interval) or \
        rec.target_pls is not None or rec.mode == "auto"
    if planned and rec.mtbf is None and faults.failure_model is None:
        raise ValueError("--ckpt-interval auto, --target-pls and --recovery auto need the job's "
                         "mean time between failures: --mtbf (or --failure-model)")
    _check_units(rec, faults)


def _check_units(rec: RecoveryConfig, faults) -> None:
    model = faults.failure_model
    if model is not None and model.scale.unit != "steps" and faults.emulated_hours is None:
        raise ValueError(f"--failure-model {model.kind} in {model.scale.unit} needs "
                         f"--emulated-hours (the length of the job the run emulates): emulated "
                         f"failures must fall on the same steps in every run")
    if faults.failure_fraction is not None and model is None:
        raise ValueError("--failure-fraction is the share of shards an emulated failure loses; "
                         "it needs --failure-model")
