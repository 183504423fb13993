"""`python -m mpickpt.train` / `mpickpt-train`: the reference hybrid-parallel DLRM trainer.

Launch with `mpiexec -n N`, `mpirun -np N` or `srun`. Bad flags, files or layouts stop every rank
before training with one message and exit status 2, never a traceback."""
from __future__ import annotations

import sys

from mpickpt.exit_codes import EXIT_BAD_INPUT, EXIT_STARTUP_FAILED
from mpickpt.phase_watch import PhaseWatch


def _agree_on_error(comm, error: str | None) -> str | None:
    """The first rank's error, if any rank has one. Collective over `comm`."""
    errors = comm.allgather(error)
    return next((e for e in errors if e), None)


def _fail(comm, message: str) -> int:
    if comm.Get_rank() == 0:
        print(f"mpickpt-train: error: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def stop_status(trainer) -> int:
    """0, or how a stop signal ended the run: EXIT_SAVED after an emergency checkpoint
    committed ("requeue me"), EXIT_SAVE_FAILED when its commit failed, else (no checkpoint
    directory) 128 + the signal's number, the shell's convention."""
    import signal

    from mpickpt.exit_codes import EXIT_SAVE_FAILED, EXIT_SAVED

    if trainer.stopped is None:
        return 0
    if trainer.ckpt is not None:
        return EXIT_SAVED if trainer.stop_committed else EXIT_SAVE_FAILED
    return 128 + int(getattr(signal, trainer.stopped, signal.SIGTERM))


def main(argv=None) -> int:
    """Parse, validate on every rank, then train. Collective over MPI.COMM_WORLD; a process
    started by a node agent to replace a dead rank joins without MPI (`replacement_main`).
    Startup, from before MPI_Init to the first step, runs under a deadline (`--startup-timeout`):
    a peer that died there would otherwise leave this rank waiting forever."""
    import os
    import signal

    from mpickpt.launch.rank_wrapper import REPLACES_VARIABLE
    from mpickpt.launch.standby import STANDBY_VARIABLE

    if os.environ.get(STANDBY_VARIABLE):
        return standby_main(argv)
    if os.environ.get(REPLACES_VARIABLE):
        # hydra's notices that a process of generation 0 ended without MPI_Finalize (the
        # survivors' ends after a recovery) must not kill a replacement still importing; its
        # stop signals are installed later
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        return replacement_main(argv)
    from mpickpt.recovery.config import RecoveryConfig
    from mpickpt.stop_signals import StopSignals
    from mpickpt.train_flags import TrainConfig

    signals = StopSignals().install()  # before anything slow: a stop then comes at step 1
    config, error = None, None
    try:
        config = TrainConfig.from_args(argv)
    except (ValueError, OSError) as e:
        error = str(e)
    limit = (config.recovery if config else RecoveryConfig()).startup_timeout
    watch = PhaseWatch("startup", limit, EXIT_STARTUP_FAILED, before_exit=_run_exit_hooks)
    watch.phase("MPI_Init")
    try:
        started = _start(config, error, signals, watch)
    except Exception:  # a peer died in the groups' rendezvous or the restore: no MPI_Finalize
        import traceback

        traceback.print_exc()
        print(f"mpickpt-train: startup failed in {watch.current}; exit status "
              f"{EXIT_STARTUP_FAILED} for a relaunch", file=sys.stderr, flush=True)
        _run_exit_hooks()
        _exit_now(EXIT_STARTUP_FAILED)
    watch.end()
    if isinstance(started, int):  # refused on every rank
        _ignore_death_notices()
        return started
    if not isinstance(started, tuple):  # a hot spare
        _tell_agent(started.rendezvous.address)
        return _serve_as_spare(started, config, signals)
    topo, trainer = started
    _tell_agent(topo.rendezvous.address if topo.rendezvous is not None else None)
    return _train(topo, trainer)


def _start(config, error, signals, watch):
    """MPI, the checks every rank agrees on, the groups, the model and its restore: the
    (topology, trainer) to train with, a `Spare` on the launch's last --spares processes, or
    the exit status of a refusal. Collective."""
    import os

    from mpi4py import MPI

    from mpickpt.launch.checks import launch_error
    from mpickpt.data.criteo_tsv import CriteoFormatError
    from mpickpt.store.errors import CheckpointError
    from mpickpt.topology import Topology
    from mpickpt.trainer import Trainer

    comm = MPI.COMM_WORLD
    error = launch_error(comm.Get_size()) or error
    if config is not None and error is None:
        try:
            config.recovery.check_launcher(os.environ, comm.Get_size())
            if comm.Get_rank() == 0:
                config.check_root_outputs()
            config.check_world(comm.Get_size() - config.recovery.spares)
        except (ValueError, OSError) as e:
            error = str(e)
    error = _agree_on_error(comm, error)
    if error:
        return _fail(comm, error)
    if comm.Get_rank() == 0:
        _record_chosen_start(config)
    watch.phase("forming the process groups")
    topo = Topology.from_mpi(comm, backend=config.run.backend, spares=config.recovery.spares)
    if not isinstance(topo, Topology):  # a spare: nothing to build until it takes a rank
        return topo
    if topo.local_rank == 0:  # once per node: a plain mpiexec's killed runs have no agent
        from mpickpt.launch.mpich_shm import remove_stale_saying

        remove_stale_saying(lambda line: print(f"mpickpt: {line}", flush=True))
    watch.phase("building the model and restoring")
    try:
        return topo, Trainer(topo, config, signals=signals)
    except (CheckpointError, CriteoFormatError) as e:  # every rank agreed on it inside
        return _fail(comm, str(e))                      # restore(), or read the same lines


def _record_chosen_start(config) -> None:
    """Rank 0, flags agreed: a first launch's chosen start over newer checkpoints is recorded
    now (`store.replacing.settle`), so that a relaunch after a failure anywhere in the
    start-up (groups, model, writers, restore) starts there again. Local."""
    import os

    from mpickpt.store import replacing

    ckpt = config.checkpoint
    if ckpt is None or ckpt.resume_in_force(os.environ, config.num_batches)[1] is not None:
        return  # no checkpoints, or a relaunch: its restore decides
    warning = replacing.settle(ckpt.directory, str(ckpt.resume), config.num_batches)
    if warning:
        print(f"mpickpt-train: warning: {warning}", file=sys.stderr, flush=True)


def _train(topo, trainer) -> int:
    """Train to the end; the exit status. Collective."""
    from mpickpt.data.criteo_tsv import CriteoFormatError, NoTrainingData
    from mpickpt.recovery.base import Unrecoverable
    from mpickpt.store.errors import CheckpointError

    status = 0
    try:
        trainer.run()
        status = stop_status(trainer)
        if status == 0 and topo.is_root and topo.rendezvous is not None:
            topo.rendezvous.complete(trainer.step)  # mpickpt-run: the run is done
    except (CriteoFormatError, NoTrainingData, Unrecoverable, CheckpointError) as e:
        # found mid-stream, on every rank at the same step (the same lines, the same injected
        # failure, an agreed restore), so this exit is collective
        if isinstance(e, CriteoFormatError):  # the model's state is sound: keep what is saved
            trainer.commit_in_flight()
        status = _fail(topo.control, str(e))
        topo.control.Barrier()
    except Exception:
        if not trainer.survival.in_place and topo.generation == 0:
            raise  # the interpreter's exit reports it and finalizes MPI
        _end_on_error(topo, trainer)
    finally:
        trainer.close()
    return _leave(topo, status, finalize=not trainer.survival.in_place)


def _end_on_error(topo, trainer) -> None:
    """An unexpected error in a job whose ranks run under agents: say it and end with status 1,
    without the interpreter's exit, whose MPI_Finalize waits forever once any rank of the
    launch died (seen: two survivors hung there after a second death during a recovery).
    Local; never returns."""
    import traceback

    traceback.print_exc()
    print(f"mpickpt-train: rank {topo.rank} failed (generation {topo.generation}); ending "
          f"without MPI_Finalize", file=sys.stderr, flush=True)
    _ignore_death_notices()
    try:
        trainer.close()
    finally:
        _run_exit_hooks()
        _exit_now(1)


def standby_main(argv=None) -> int:
    """A node agent's warm standby (`mpickpt.launch.standby`): warm up now, wait for the agent to
    hand over a dead trainer's place, then go on as its replacement; status 0 when the agent
    ends first. Local until it takes over."""
    import os

    from mpickpt.generation import STORE_VARIABLE
    from mpickpt.launch.rank_wrapper import REPLACES_VARIABLE
    from mpickpt.launch.standby import read_assignment
    from mpickpt.spares import warm_up
    from mpickpt.train_flags import TrainConfig

    warm_up(TrainConfig.from_args(argv))  # the flags the job started with: already checked
    assignment = read_assignment(sys.stdin.buffer)
    if assignment is None:
        return 0
    os.environ[REPLACES_VARIABLE], os.environ[STORE_VARIABLE] = assignment
    return replacement_main(argv)


def replacement_main(argv=None) -> int:
    """A trainer started by its node agent in place of a dead one: join the survivors' next
    generation over the rendezvous store (no MPI), recover the lost shard, train on. Collective
    with that generation. Its startup runs under the same deadline as a first start's. A respawn
    whose rank a hot spare took first, or the respawn of a spare, serves as a spare."""
    import os

    from mpickpt.generation import (STORE_TIMEOUT_S, STORE_VARIABLE, Rendezvous, SlotTaken,
                                    connect_store)
    from mpickpt.launch.rank_wrapper import REPLACES_VARIABLE
    from mpickpt.spares import Spare
    from mpickpt.stop_signals import StopSignals
    from mpickpt.topology import Topology, choose_backend, local_rank_from_env
    from mpickpt.train_flags import TrainConfig

    # born ignoring them (`rank_wrapper._replacement_start`): the handlers replace SIG_IGN
    # at once, and their removal at the end gives back the defaults, not SIG_IGN
    signals = StopSignals().install(restore_defaults=True)
    signals.mute_death_notices(60.0)  # hydra's notices of the death this process answers
    slot, size, dead = (os.environ[REPLACES_VARIABLE].split("/") + [""])[:3]
    config = TrainConfig.from_args(argv)  # the flags the job started with: already checked
    rank, world = int(slot), int(size) - config.recovery.spares
    address, local_rank = os.environ[STORE_VARIABLE], local_rank_from_env() or 0
    join_s = config.recovery.join_timeout
    # the main thread's client (the startup watch and a fallback open their own)
    rendezvous = Rendezvous(connect_store(address, join_s), address)
    if rank < world:
        try:
            topo, trainer = _join_and_build(
                config, signals, f"the replacement of rank {rank}",
                lambda: Topology.from_store(address, rank, world, local_rank,
                                            backend=config.run.backend, join_timeout_s=join_s,
                                            rendezvous=rendezvous, dead=dead or None),
                rendezvous)
            return _train(topo, trainer)
        except SlotTaken as e:
            print(f"mpickpt-train: {e}; this process serves as a spare", file=sys.stderr,
                  flush=True)
    if dead:  # the dead process (a spare, or a respawn serving as one) may hold another slot
        rendezvous.record_if_held(dead, world)
    spare = Spare(rendezvous, world, local_rank, 1, choose_backend(config.run.backend),
                  STORE_TIMEOUT_S)
    return _serve_as_spare(spare, config, signals)


def _serve_as_spare(spare, config, signals) -> int:
    """Wait for a dead rank's slot, then train as that rank; or leave when the job ends
    (without MPI_Finalize, as the trainers under agents do: a launched spare's would wait for
    them forever). Collective with the generation it joins, if any."""
    from mpickpt.exit_codes import EXIT_PEER_LOST
    from mpickpt.generation import JobOver
    from mpickpt.topology import Topology

    def say(message):
        print(f"mpickpt-train: {message}", file=sys.stderr, flush=True)
    signals.notices_only()  # hydra's notices of the deaths a spare waits for are no stops
    outcome = spare.over()  # a respawn that came too late leaves at once
    if outcome is None:
        warm = spare.warm_up(config)
        say(f"spare: waiting for a dead rank's slot (warmed up in {warm:.2f} s)")
        outcome = spare.wait(say)
    if isinstance(outcome, JobOver):
        _ignore_death_notices()
        say(f"spare: leaving: {outcome}")
        spare.rendezvous.done()
        _run_exit_hooks()  # no MPI_Finalize: the trainers, under agents, end without it too
        _exit_now(EXIT_PEER_LOST if outcome.relaunch else 0)
    generation, rank = outcome
    topo, trainer = _join_and_build(
        config, signals, f"spare taking rank {rank}",
        lambda: Topology.from_store(spare.rendezvous.address, rank, spare.world,
                                    spare.local_rank, spare.local_size, spare.backend,
                                    spare.timeout_s, config.recovery.join_timeout,
                                    rendezvous=spare.rendezvous, generation=generation),
        spare.rendezvous)
    return _train(topo, trainer)


def _join_and_build(config, signals, what: str, join, rendezvous):
    """`join()` (a Topology of a later generation), then the Trainer, under the startup
    deadline; a failure ends the process with EXIT_STARTUP_FAILED (the survivors' formation then
    fails too), after saying at the store that the job falls back to a relaunch where the
    generation refused it while it joined or the deadline passed (any other joiner ends then
    too), and so does the job's fallback to a relaunch meanwhile (`rendezvous` says so:
    a process stuck in a group's rendezvous with a member that died would wait for the store's
    timeout). The watch asks on a store client of its own: the main thread's is held by such a
    wait. SlotTaken passes through. Collective with the generation joined."""
    from mpickpt.generation import SlotTaken
    from mpickpt.trainer import Trainer

    own: list = []

    def abandoned() -> str | None:
        try:
            if not own:
                own.append(_own_client(rendezvous))
            over = own[0].job_over()
        except (RuntimeError, OSError):  # the store did not answer: ask again next time
            own.clear()
            return None
        return str(over) if over is not None and over.relaunch else None

    def fall_back(why: str) -> None:
        """Say at the store that the job falls back to a relaunch: the members and joiners
        still waiting for this generation (their `FormationWatch`, a joiner's startup watch)
        end at once instead of at their timeouts, also where no survivor is left to say it."""
        try:
            _own_client(rendezvous).give_up(f"{what} failed: {why}")
        except (RuntimeError, OSError):
            pass  # the store is gone: the job is over anyway

    def before_exit() -> None:
        fall_back(f"its startup did not finish within {config.recovery.startup_timeout:.0f} s")
        _run_exit_hooks()

    watch = PhaseWatch(f"startup of {what}", config.recovery.startup_timeout,
                       EXIT_STARTUP_FAILED, before_exit=before_exit, abandoned=abandoned)
    joining = True
    try:
        watch.phase("joining the next generation")
        topo = join()
        joining = False
        watch.phase("recovering the lost shard")
        trainer = Trainer(topo, config, signals=signals)
    except SlotTaken:
        watch.end()
        raise
    except Exception as e:
        import traceback

        from mpickpt.generation import GenerationError

        refused = isinstance(e, GenerationError)  # the generation's own refusal: no stack
        if not refused:
            traceback.print_exc()
        print(f"mpickpt-train: {what} failed in {watch.current}" + (f" ({e})" if refused else "")
              + f"; exit status {EXIT_STARTUP_FAILED}", file=sys.stderr, flush=True)
        if refused and joining:  # no generation to join: nobody else may say so (a failure
            # later, e.g. at the run's end where survivors end it alone, is theirs to settle)
            fall_back(str(e))
        _run_exit_hooks()
        _exit_now(EXIT_STARTUP_FAILED)
    watch.end()
    return topo, trainer


def _own_client(rendezvous):
    """A `Rendezvous` on a store connection of its own (a TCPStore client serves one thread at a
    time; a 2 s connect, within the startup watch's time for its exit hook), or `rendezvous`
    itself where it has no address (tests). Local."""
    from mpickpt.generation import Rendezvous, connect_store

    if rendezvous.address is None:
        return rendezvous
    return Rendezvous(connect_store(rendezvous.address, 2.0), rendezvous.address)


def _tell_agent(address: str | None) -> None:
    """Tell this rank's node agent, if it has one, that startup is over (a death is no longer a
    failed start), and leave the store's address there for a replacement. Local."""
    import os

    from mpickpt.launch.rank_wrapper import AGENT_VARIABLE, STARTED_FILE

    folder = os.environ.get(AGENT_VARIABLE)
    if not folder or not os.path.isdir(folder):
        return
    tmp = os.path.join(folder, STARTED_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(address or "")
    os.replace(tmp, os.path.join(folder, STARTED_FILE))


def _leave(topo, status: int, finalize: bool = True) -> int:
    """Release the groups and say this rank is done with the store. MPI_Finalize waits
    forever for a rank that died (after a change of generation, or a death after the last
    step: measured, the survivors of a kill right after the digest hung there), and a
    replacement never joined MPI: in place (`finalize` False: the ranks run under agents,
    which delete the MPI segments left behind) and after a change of generation the exit hooks
    run and the process ends without it. Otherwise (plain mpiexec, in place off) the
    interpreter's exit finalizes MPI (an explicit MPI_Finalize under a deadline, followed by
    os._exit, ended ranks by SIGKILL after their last step in 3 CI tests of 400, not reproduced
    by hand)."""
    _ignore_death_notices()
    generation = topo.generation
    if topo.rendezvous is not None:
        topo.rendezvous.done(completed=status == 0)
    # The process group is released here: a gloo group left to the interpreter's teardown can
    # abort the process ("terminate called without an active exception", exit status 6).
    topo.close()
    if finalize and generation == 0 and not topo.replacement:
        return status
    _run_exit_hooks()
    _exit_now(status)


def _ignore_death_notices() -> None:
    """This rank is leaving: hydra's SIGUSR1, its notice that a peer exited with a non-zero
    status (a refusal, a stop's 75) or without MPI_Finalize, must not kill it on the way out
    (its agent would take that for a death and the run for a failed one). Local."""
    import signal

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _run_exit_hooks() -> None:
    import atexit

    atexit._run_exitfuncs()


def _exit_now(status: int):
    """End the process without the interpreter's teardown, where MPI_Finalize would run (and
    wait for a dead peer). The exit hooks ran before. Local; never returns."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
