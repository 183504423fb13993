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
    """Parse, validate on every rank, then train. Collective over MPI.COMM_WORLD."""
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
        status = _fail(comm, str(e))
        comm.Barrier()
    finally:
        trainer.close()
    # Both exits release the process group: a gloo group left to the interpreter's teardown can
    # abort the process ("terminate called without an active exception", exit status 6).
    topo.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
