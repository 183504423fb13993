"""`python -m mpickpt.train` / `mpickpt-train`: the reference hybrid-parallel DLRM trainer.

Launch with `mpiexec -n N`, `mpirun -np N` or `srun`. Bad flags, files or layouts stop every rank
before training with one message and exit status 2, never a traceback."""
from __future__ import annotations

import sys

EXIT_BAD_INPUT = 2


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

    from mpickpt.stop_signals import EXIT_SAVE_FAILED, EXIT_SAVED

    if trainer.stopped is None:
        return 0
    if trainer.ckpt is not None:
        return EXIT_SAVED if trainer.stop_committed else EXIT_SAVE_FAILED
    return 128 + int(getattr(signal, trainer.stopped, signal.SIGTERM))


def main(argv=None) -> int:
    """Parse, validate on every rank, then train. Collective over MPI.COMM_WORLD; a process
    started by a node agent to replace a dead rank joins without MPI (`replacement_main`)."""
    import os

    from mpickpt.generation import REPLACES_VARIABLE

    if os.environ.get(REPLACES_VARIABLE):
        return replacement_main(argv)
    from mpi4py import MPI

    from mpickpt.data.criteo_tsv import CriteoFormatError
    from mpickpt.launch.checks import launch_error
    from mpickpt.stop_signals import StopSignals
    from mpickpt.recovery.base import Unrecoverable
    from mpickpt.store.errors import CheckpointError
    from mpickpt.topology import Topology
    from mpickpt.train_flags import TrainConfig
    from mpickpt.trainer import Trainer

    signals = StopSignals().install()  # before anything slow: a stop then comes at step 1
    comm = MPI.COMM_WORLD
    error, config = launch_error(comm.Get_size()), None
    try:
        config = TrainConfig.from_args(argv)
        config.check_world(comm.Get_size())
    except (ValueError, OSError) as e:
        error = error or str(e)
    error = _agree_on_error(comm, error)
    if error:
        return _fail(comm, error)
    topo = Topology.from_mpi(comm, backend=config.run.backend)
    _tell_agent(topo)
    try:
        trainer = Trainer(topo, config, signals=signals)
    except CheckpointError as e:  # every rank agreed on it inside restore()
        return _fail(comm, str(e))
    status = 0
    try:
        trainer.run()
        status = stop_status(trainer)
    except (CriteoFormatError, Unrecoverable, CheckpointError) as e:
        # found mid-stream, on every rank at the same step (the same lines, the same injected
        # failure, an agreed restore), so this exit is collective
        status = _fail(topo.control, str(e))
        topo.control.Barrier()
    finally:
        trainer.close()
    return _leave(topo, status)


def replacement_main(argv=None) -> int:
    """A trainer started by its node agent in place of a dead one: join the survivors' next
    generation over the rendezvous store (no MPI), recover the lost shard, train on. Collective
    with that generation."""
    import os

    from mpickpt.generation import REPLACES_VARIABLE, STORE_VARIABLE
    from mpickpt.recovery.base import Unrecoverable
    from mpickpt.stop_signals import StopSignals
    from mpickpt.store.errors import CheckpointError
    from mpickpt.topology import Topology, local_rank_from_env
    from mpickpt.train_flags import TrainConfig
    from mpickpt.trainer import Trainer

    signals = StopSignals().install()
    rank, _, world = os.environ[REPLACES_VARIABLE].partition("/")
    config = TrainConfig.from_args(argv)  # the flags the job started with: already checked
    topo = Topology.from_store(os.environ[STORE_VARIABLE], int(rank), int(world),
                               local_rank_from_env() or 0, backend=config.run.backend,
                               join_timeout_s=config.recovery.join_timeout)
    trainer = Trainer(topo, config, signals=signals)
    status = 0
    try:
        trainer.run()
        status = stop_status(trainer)
    except (Unrecoverable, CheckpointError) as e:
        status = _fail(topo.control, str(e))
    finally:
        trainer.close()
    return _leave(topo, status)


def _tell_agent(topo) -> None:
    """Leave the store's address where this rank's node agent finds it for a replacement."""
    import os

    from mpickpt.generation import AGENT_VARIABLE

    folder = os.environ.get(AGENT_VARIABLE)
    if folder and topo.rendezvous is not None and topo.rendezvous.address:
        tmp = os.path.join(folder, "store.tmp")
        with open(tmp, "w") as f:
            f.write(topo.rendezvous.address)
        os.replace(tmp, os.path.join(folder, "store"))


def _leave(topo, status: int) -> int:
    """Release the groups and say this rank is done with the store. After a change of
    generation, MPI_Finalize would wait forever for the dead rank (and a replacement never
    joined MPI): the exit hooks run and the process ends without it."""
    import atexit
    import os

    generation = topo.generation
    if topo.rendezvous is not None:
        try:
            topo.rendezvous.store.add("finished", 1)
        except (RuntimeError, OSError):
            pass
    # Both exits release the process group: a gloo group left to the interpreter's teardown can
    # abort the process ("terminate called without an active exception", exit status 6).
    topo.close()
    if generation == 0 and not topo.replacement:
        return status
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
