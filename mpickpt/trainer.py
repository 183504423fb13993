"""The synchronous training loop: reader -> hybrid step -> progress, tests, digest."""
from __future__ import annotations

import json
import os
import time
import torch

from mpickpt.background import error_line
from mpickpt.data.criteo_tsv import (CriteoFormatError, CriteoTSVConfig, CriteoTSVSource,
                                     NoTrainingData)
from mpickpt.data.position import SyntheticPosition, TSVPosition, position_from_dict
from mpickpt.data.prefetch import PrefetchReader
from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
from mpickpt.engine.manager import CheckpointManager
from mpickpt.engine.restorer import Restorer
from mpickpt.evaluation import evaluate
from mpickpt.model.registry import build_model
from mpickpt.parity import shared_rows
from mpickpt.parity.guard import ParityGuard
from mpickpt.progress import ProgressLog
from mpickpt.faults.loss import Loss
from mpickpt.generation import GenerationError
from mpickpt.job_variables import relaunches
from mpickpt.recovery.tolerance import FaultTolerance
from mpickpt.run_report import RunReport
from mpickpt.stop_signals import StopSignals, stop_failed_message
from mpickpt.store.errors import CheckpointError
from mpickpt.survivors.inplace import InPlace, Rejoined
from mpickpt.survivors.survival import COMM_ERRORS, Survival, restart_count
from mpickpt.timing import PhaseTimer

# The synthetic test set is the same planted stream far beyond any training index.
SYNTHETIC_TEST_OFFSET = 1 << 48


def make_sources(config, check_test: bool = True):
    """(train source, its start state, test source, its start state). `check_test`: parse the
    `--raw-test-file` lines the tests will read now (a replacement's launch checked them
    already: its start is a recovery's critical path). Local."""
    data = config.data
    if data.data_generation == "synthetic":
        stream = SyntheticStream(SyntheticConfig(
            table_sizes=config.table_sizes, pooling=data.num_indices_per_lookup,
            zipf_alpha=data.zipf_alpha, seed=config.model.seed))
        return (stream, SyntheticPosition(sample_index=0),
                stream, SyntheticPosition(sample_index=SYNTHETIC_TEST_OFFSET))

    def source(files):
        return CriteoTSVSource(CriteoTSVConfig(paths=files, table_sizes=config.table_sizes,
                                               skip_bad_lines=data.skip_bad_lines))
    train = source(data.files(train=True))
    test = train
    if data.files(train=False):
        test = source(data.files(train=False))
        if check_test:  # its lines, read at the first test, checked before training
            test.check(TSVPosition(), config.run.test_num_batches * config.global_batch)
    return train, TSVPosition(), test, TSVPosition()


class Trainer:
    """Owns the model, the reader, the checkpoint manager and the loop. `run` is collective."""

    def __init__(self, topo, config, log: ProgressLog | None = None,
                 signals: StopSignals | None = None):
        """`signals`: stop signals installed by the entry point before anything slow (a signal
        during a long restore then stops after the first step); installed here otherwise."""
        self.topo, self.config = topo, config
        self.signals = signals or StopSignals().install()
        self.timer = PhaseTimer(topo.device, enabled=config.run.phase_times)
        self.model = build_model(config.model.model, topo, config, self.timer)
        self.shared_rows = shared_rows.for_parity(self.model, config.parity)
        self.log = log or ProgressLog(topo.is_root, config.num_batches, config.run.print_freq)
        self.source, first, self.test_source, self.test_start = make_sources(
            config, check_test=not topo.replacement)
        self.ckpt = self.restorer = None
        self.split = self._core_split()
        if config.checkpoint is not None:
            self.ckpt = CheckpointManager(topo, config.checkpoint, self.model, self.log.say,
                                          self.split)
            resume, note = config.checkpoint.resume_in_force(os.environ, config.num_batches)
            if not topo.replacement:  # rank 0's reading of the launch, on every rank
                resume, note = topo.control.bcast((resume, note), root=0)
                if note:
                    self.ckpt.say(note)
            self.restorer = Restorer(topo, config.checkpoint.directory, self.model, self.ckpt.say,
                                     resume, train_until=config.num_batches,
                                     first_launch=not relaunches(os.environ)
                                     and not topo.replacement)
        self.parity = ParityGuard(topo, self.model, config.parity, self.log.say,
                                  self._widen, self.shared_rows) \
            if config.parity is not None else None
        rec = config.recovery
        self.survival = Survival(topo, self.model, self.parity, config.checkpoint and
                                 config.checkpoint.directory,
                                 rec.dumps_mode(os.environ, config.checkpoint is not None),
                                 rec.peer_timeout, self.log.say,
                                 in_place=rec.in_place_wanted(os.environ),
                                 on_notice=self._on_death_notice)
        self.in_place = InPlace(topo, self.model, self.survival.undo, self.parity,
                                rec.join_timeout, history=self._history,
                                faults=lambda: self.faults.state())
        note = None if topo.replacement else rec.dumps_note(os.environ)
        if note:
            self.log.say(note)
        if self.survival.in_place and rec.spares:
            self.signals.notices_only()  # a spare's death reaches the ranks only as SIGUSR1
        self.generations: list[dict] = []
        """One record per in-place recovery this process took part in."""
        self._left_at = None
        self._recovered_by: str | None = None
        """The policy of the last recovery (a generation's log names it)."""
        self.dumps_step: int | None = None
        """The step of the survivor dumps kept until a newer checkpoint commits (None: none
        kept)."""
        self.finish_done: list[str] = []
        """The phases of the run's end (`_finish`) completed, in order."""
        self.step, start, pls, lost = self._join_as_replacement() if topo.replacement \
            else self._resume(first)
        self.faults = FaultTolerance(config, topo, self.model, self.ckpt, self.restorer,
                                     self.parity, self.log.say, self.step, pls, first.to_dict())
        self._pin_training()  # after the counts of free cores above, which read the whole mask
        if not topo.replacement:  # a replacement's position comes from the living job
            start = self._check_data_position(start, first)
        self.reader = self._make_reader(start)
        self.log.restart_at(self.step, said=False)
        if topo.replacement:
            self.faults.adopt(self._joined.faults)
        self.report = RunReport(config.run.run_report, topo.is_root, self.step)
        if topo.replacement and self._joined.history is not None:
            self._adopt(self._joined.history)
        self.executed = 0
        self.votes = torch.zeros(1)
        self.stopped: str | None = None
        self.stop_committed = False
        """The emergency checkpoint of the step a stop signal ended at was committed."""
        self.tail_bad_lines = 0
        """Malformed lines among those the end of the data left untrained (`_leftover_lines`)."""
        self._say_if_nothing_is_due()
        if topo.replacement:
            self._injected_settling_kill()
        self.survival.start_watch(self._boundary)  # first: a death during recovery is seen
        if lost:
            self._recover(Loss.of_ranks(lost, self.step, self.model.plan))

    def _say_if_nothing_is_due(self) -> None:
        """Say at the start (rank 0) when the run resumed at or past its last step (nothing to
        train), or ends before its next checkpoint is due and --ckpt-final is off: nothing would
        be saved but a stop signal's. Local."""
        cfg = self.config
        if self.step >= cfg.num_batches and self.step and not self.topo.replacement:
            self.log.say(f"nothing left to train: resumed at step {self.step}, at or past "
                         f"--num-batches {cfg.num_batches} (raise it to train on)")
            return
        if self.ckpt is None or cfg.checkpoint.final or self.topo.replacement or \
                self.step >= cfg.num_batches:
            return
        due = self.ckpt.schedule.next
        if due > cfg.num_batches:
            self.log.say(f"no checkpoint is due in this run: the next one at step {due}, "
                         f"after its end at step {cfg.num_batches} (--ckpt-interval "
                         f"{self.ckpt.schedule.interval}); only a stop signal would save one, "
                         f"--ckpt-final saves the last step")

    def _resume(self, first):
        """Where training starts: survivor dumps of a relaunch, else the newest checkpoint, else
        the beginning. Returns (step, reader position, the PLS stats it carried, ranks lost at
        the relaunch). Collective."""
        newest = self.restorer.newest_step() if self.restorer is not None else None
        if self.restorer is not None and self.restorer.resume != "latest":
            self.survival.start_anew()  # a chosen start: older jobs' dumps are no relaunch's
            survey, found = None, None
        else:
            survey, found = self.survival.resume(newest)
        if found is not None:
            reader, pls = found
            self.ckpt.resumed_at(survey.step)
            self.dumps_step = survey.step
            return survey.step, position_from_dict(reader), pls, sorted(survey.lost)
        restored = self.restorer.restore() if self.restorer is not None else None  # collective
        imported = self._import_dcp(first) if restored is None else None
        if restored is not None and self.config.model.import_dcp is not None:
            self.log.say(f"--import-dcp {self.config.model.import_dcp}: not imported: "
                         f"{self.restorer.root} holds checkpoints, and the job resumed from step "
                         f"{restored.step} (an import starts a job whose --ckpt-dir holds none)")
        if self.parity is not None:
            self.parity.encode()  # collective
        if imported is not None:
            return (*imported, None, [])
        if restored is None:
            return 0, first, None, []
        self.ckpt.restored(restored)
        return (restored.step, position_from_dict(restored.reader_state),
                restored.manifest.stats.get("pls"), [])

    def _import_dcp(self, first):
        """--import-dcp: the model from a DCP checkpoint, as the first checkpoint of
        --ckpt-dir. Returns (step, reader position), from where mpickpt exported it, else
        (0, the start). None without the flag. Collective."""
        path = self.config.model.import_dcp
        if path is None:
            return None
        from torch.distributed.checkpoint.api import CheckpointException

        from mpickpt.model.torchrec_dcp import load_dcp

        start = time.perf_counter()
        try:
            meta = load_dcp(self.model, path, self.log.say)
        except (ValueError, CheckpointException) as e:  # a BaseException; DCP's planning
            raise CheckpointError(  # gathers every rank's errors and raises them on all ranks:
                f"--import-dcp {path}: cannot be loaded into this model: "  # an agreed refusal
                f"{_last_error_line(e)}") from None
        step, position = (meta["step"], position_from_dict(meta["reader"])) if meta else \
            (0, first)
        self.log.say(f"imported DCP checkpoint {path} at step {step} in "
                     f"{time.perf_counter() - start:.2f} s"
                     + ("" if meta else " (not written by mpickpt: training starts at step 0 "
                        "with the reader at the start)"))
        if self.ckpt is not None:
            self.ckpt.resumed_at(step)
            self.ckpt.save(step, position.to_dict(), wait=True)
        return step, position

    def _join_as_replacement(self):
        """A process that replaces a dead rank: agree with the survivors on the step and take
        the dense part, reader position and PLS from them (the shard itself is recovered after
        the trainer is built, by `--recovery`). Collective with the generation's members."""
        joined = self.in_place.replacement()
        self._take_over(joined)
        self._joined = joined
        return joined.step, position_from_dict(joined.reader), joined.pls, \
            sorted(set(joined.replaced) | set(joined.unrebuilt))

    def _history(self) -> dict:
        """This rank's record of the run (its report's events, its checkpoint counts), for a
        process that replaces rank 0. Local."""
        return {"report": self.report.record(),
                "checkpoints": self.ckpt.record() if self.ckpt is not None else None}

    def _adopt(self, history: dict) -> None:
        """This process replaces rank 0: go on from a survivor's record of the run, so that
        the report and the summaries cover the whole run. Local."""
        self.report.adopt(history["report"])
        if self.ckpt is not None and history["checkpoints"] is not None:
            self.ckpt.adopt(history["checkpoints"], self.step)
            self.ckpt.drop_unfinished()

    def _take_over(self, joined: Rejoined) -> None:
        """Checkpointing continues from the agreed step: a new baseline next, the job's attempt
        id and interval. Where a survivor had closed its checkpoints (the run's end, or a
        stop's checkpoint), every member stops its writers now, before the recovery: a recovery
        that reads checkpoints (partial, a rollback) and the steps after it then make the same
        (no) checkpoint collectives on the survivors that closed, a survivor that lagged in the
        close, and a replacement. Local."""
        # the replaced shards' recovery (a parity rebuild) is settled again by every member
        self.finish_done = [p for p in joined.finish_done if p != "settle"]
        # survivor dumps a relaunch resumed from: every member watches for the newer commit
        self.dumps_step = joined.dumps_from
        if self.ckpt is not None:
            self.ckpt.generation_formed()
            if joined.checkpoints_closed:  # the run's end or a stop's checkpoint committed
                self.ckpt.abort(summary=True)  # every commit it would make: stop the writers
            self.ckpt.resumed_at(joined.step)
            if joined.attempt is not None:
                self.ckpt.attempt = joined.attempt
            if joined.interval is not None:
                self.ckpt.schedule.interval = joined.interval
                self.ckpt.schedule.restart(joined.step)

    def _core_split(self):
        """The split of this rank's cores that --ckpt-cores asks for (None: shared), said on
        rank 0 (`auto` says nothing where it does not split). Collective unless shared or
        this process replaces a dead rank (it does not know its node's masks, and the
        survivors are not starting: it shares its cores)."""
        from mpickpt.engine import core_split

        cfg = self.config.checkpoint
        if cfg is None or cfg.cores == "shared":
            return None
        if getattr(self.topo, "replacement", False):
            why = "a replacement process does not know its node's other ranks"
            split = None
        else:
            index, masks = core_split.node_masks(self.topo.control)
            split, why = core_split.plan(cfg.cores, index, masks, self.topo.device.type,
                                         torch.get_num_threads())
        if split is not None:
            self.log.say(f"--ckpt-cores {cfg.cores}: {split.describe()} (rank 0)")
        elif cfg.cores == "split":
            self.log.say(f"--ckpt-cores split: no split ({why}); training and the background "
                         f"share the cores")
        return split

    def _pin_training(self) -> None:
        """Training's threads on the split's training cores (a CPU rank's torch workers and
        gloo threads too; a GPU rank's feeding thread alone). Local."""
        if self.split is None:
            return
        problem = self.split.pin_training(workers=self.topo.device.type != "cuda")
        if problem:
            self.log.say(f"--ckpt-cores: training keeps every core: {problem}")

    def _widen(self) -> None:
        """On a helper thread training starts (the reader, the rebuild's): the whole share of a
        core split, not just training's cores. Local."""
        if self.split is not None:
            self.split.widen()

    def _check_data_position(self, start, first):
        """The resumed reader position, checked against the data: CheckpointError where it is
        another source's (`first`: this run's start), CriteoFormatError on every rank when the
        data files changed under it on any rank's node (`CriteoTSVSource.changed_since`):
        nothing is read from a position that means nothing in the files. Past a line end
        appended to a last line that had none (`CriteoTSVSource.completed_line`). Collective
        (local where it raises: every rank resumed the same checkpoint)."""
        if type(start) is not type(first):
            kinds = start.to_dict()["kind"], first.to_dict()["kind"]
            raise CheckpointError(
                f"the resumed checkpoint's reader read {kinds[0]} data, and this run reads "
                f"{kinds[1]} data (--data-generation {self.config.data.data_generation}): "
                f"resume it with the data flags of the run that wrote it, or start in another "
                f"--ckpt-dir")
        if not isinstance(self.source, CriteoTSVSource) or start == TSVPosition():
            return start
        error = self.source.changed_since(start)
        said = self.topo.control.allgather(None if error is None else
                                           (error.path, error.line_number, error.problem))
        first_said = next((s for s in said if s is not None), None)
        if first_said is not None:
            raise CriteoFormatError(*first_said)
        # rank 0's reading for every rank: a file appended to meanwhile reads alike everywhere
        return self.topo.control.bcast(self.source.completed_line(start)
                                       if self.topo.is_root else None, root=0)

    def _make_reader(self, start) -> PrefetchReader:
        cfg = self.config
        allowance = self.ckpt.allowance(self.step, cfg.num_batches) if self.ckpt else None
        return PrefetchReader(self.source, global_batch=cfg.global_batch, rank=self.topo.rank,
                              world=self.topo.world_size, state=start,
                              depth=cfg.data.prefetch_depth,
                              allowance=allowance, read_ahead=cfg.data.prefetch_depth,
                              place=self._widen)
        # the reader keeps its queue full through a checkpoint: drained there, its refill (the
        # batch after it read after the save, then depth more at once) slowed the step after
        # every checkpoint by 4-8 ms here (its reads hold the GIL the step's waits need)

    def run(self) -> None:
        """Train up to `num_batches` steps (or to the end of the data, or a stop signal).
        Collective. A peer's death either moves the job to its next generation in place (this
        process goes on) or ends this rank through `Survival` (exit EXIT_PEER_LOST); so does a
        death while a generation settles in (its recovery's log), which comes back here."""
        dead, joined = None, self.topo.replacement
        while True:
            try:
                if joined:  # a replacement's first generation, which a death may end too
                    joined = False
                    self._joined_log(self._joined, 0.0)
                if dead is not None:
                    self._rejoin(dead)
                    dead = None
                started = time.perf_counter()
                try:
                    self._loop()
                finally:
                    self.report.looped(time.perf_counter() - started)
                self._finish()
                return
            except Exception as e:
                dead = self.survival.failed(e)  # re-raises unless a peer died
                self._injected_kill(interrupted=True)

    def _on_death_notice(self) -> None:
        """On the watch thread, the moment a peer's death is known: mute the death notices a
        signal would bring, and let a rank named by `--inject-kill` for the step that death
        broke die now (in place or not: a relaunch must not find it alive). Local."""
        self.signals.mute_death_notices(10.0)
        if hasattr(self, "step"):
            self._injected_kill(interrupted=True)

    def _injected_kill(self, interrupted: bool = False) -> None:
        """`--inject-kill`: SIGKILL this rank if it is named for the step it finished (or, when
        `interrupted` by a peer's death, for the step that death broke). Local."""
        kill = self.config.faults.inject_kill
        if kill is not None and self._first_life():
            kill.maybe_kill(self.step, self.topo.rank, interrupted)

    def _injected_settling_kill(self) -> None:
        """`--inject-kill-settling`: SIGKILL this rank if it is named, now that generation 1
        formed and before its peer watch stands. Local."""
        kill = self.config.faults.inject_kill_settling
        if kill is not None:
            kill.maybe_kill(self.topo.generation, self.topo.rank, restart_count(os.environ))

    def _first_life(self) -> bool:
        """The job's first launch and generation: an injected kill fires there only, not again
        in a replacement, an in-place rollback or a relaunch that replays its step. Local."""
        return self.topo.generation == 0 and not self.topo.replacement and \
            restart_count(os.environ) == 0

    def _rejoin(self, dead: set[int]) -> None:
        """In place: undo the step the death interrupted, leave the broken generation, form the
        next one with the dead ranks' replacements and agree on a step, then recover the
        replaced shards by `--recovery`. Collective with the next generation's members. Falls
        back to a relaunch (dump, exit EXIT_PEER_LOST) when the generation cannot be formed."""
        started = time.perf_counter()
        with self.model.state_lock:
            self._left_at = self._boundary()
            self.survival.undo.undo_current()
        dead = dead | self.survival.leave_generation()
        step, reader, pls = self._left_at
        self.reader.close()
        attempt = interval = None
        if self.ckpt is not None:
            abandoned = self.ckpt.leave_generation()
            attempt, interval = self.ckpt.attempt, self.ckpt.schedule.interval
            if abandoned:
                self.log.say(f"checkpoint(s) of step(s) {abandoned} abandoned: rank(s) "
                             f"{sorted(dead)} died before they were written everywhere")
        uncovered = self.faults.recovery.why_not(Loss.of_ranks(sorted(dead), step,
                                                               self.model.plan))
        if uncovered is not None:  # a replacement could not recover its shard: relaunch now
            self.survival.give_up_in_place(dead, f"nothing in place can recover it: {uncovered}")
        if self.topo.rank == min(set(range(self.topo.world_size)) - dead):  # rank 0 may be dead
            print(f"rank(s) {sorted(dead)} died after step {step}: the survivors keep their "
                  f"processes and wait for the replacement(s) (generation "
                  f"{self.topo.generation + 1})", flush=True)
        try:
            joined = self.in_place.survivor(dead, step, reader, pls, attempt, interval,
                                            self.survival.more_dead, self.finish_done,
                                            self._went_back,
                                            self.ckpt is not None and self.ckpt.closed,
                                            self.dumps_step)
        except (GenerationError, *COMM_ERRORS) as e:
            # the old ring stays open: the fallback is at the store before the others see this
            # rank's connections close (at its exit) and give up too
            self.survival.give_up_in_place(dead | self.survival.more_dead(), str(e))
        left = time.perf_counter() - started
        self.step = joined.step
        self.faults.adopt(joined.faults)
        for phase in (p for p in joined.finish_done if p not in self.finish_done):
            print(f"mpickpt: rank {self.topo.rank}: another survivor completed the {phase} "
                  f"phase of the run's end, which this rank was ending: it ends it alone",
                  flush=True)
        self._take_over(joined)
        self.reader = self._make_reader(position_from_dict(joined.reader))
        self._left_at = None  # a dump from here on takes the step and reader above
        self.log.restart_at(self.step)
        self._settle_in(joined, dead)
        self.signals.mute_death_notices(3.0)
        self._joined_log(joined, left, dead)

    def _went_back(self, step: int, reader: dict) -> None:
        """The generation agreed on `step`, one before this rank's: its rows went back to it
        (under the state lock), so a survivor dump from now on says so. Local."""
        self._left_at = (step, reader, self._left_at[2])

    def _settle_in(self, joined: Rejoined, dead: set[int]) -> None:
        """A survivor in the generation it just formed: watch the peers, then recover the
        replaced shards (and those whose parity rebuild the death interrupted). Collective.
        The new ring comes first, so that a death during the recovery is seen. Until it stands,
        the old ring goes on watching the survivors, and the topology's `FormationWatch` the
        replacements (their respawns record the death): a death there, or during the recovery,
        falls back to a relaunch, with no survivor dump in the second case (the recovery may
        have changed this rank's rows half-way)."""
        self._injected_settling_kill()
        try:
            self.survival.start_watch(self._boundary)
        except COMM_ERRORS as e:
            self.survival.give_up_in_place(dead, f"a member of generation {joined.generation} "
                                                 f"died while its peer watch formed ({e})")
        self.survival.left_generation()
        self.topo.formed()
        lost = sorted(set(joined.replaced) | set(joined.unrebuilt))
        if not lost:
            return
        try:
            self._recover(Loss.of_ranks(lost, self.step, self.model.plan))
        except Exception as e:
            more = self.survival.failed(e)  # re-raises unless a peer died
            self.survival.give_up_in_place(
                more, f"rank(s) {sorted(more)} died while generation {joined.generation} "
                      f"recovered ranks {lost}", dump=False)

    def _joined_log(self, joined: Rejoined, seconds: float, dead=None) -> None:
        """Log one in-place recovery (rank 0) and append it to the restart log. Collective
        (the recovery's time is the max over the members)."""
        total = self.topo.control.allreduce(seconds, op="max")
        phases: dict[str, float] = {}  # the slowest member's, whichever rank prints them (a
        for mine in self.topo.control.allgather(joined.seconds):  # replacement has no join)
            for k, v in mine.items():
                phases[k] = max(phases.get(k, 0.0), v)
        record = {"generation": joined.generation, "step": joined.step,
                  "replaced": joined.replaced, "unrebuilt": joined.unrebuilt,
                  "undone": joined.undone,
                  "pids": joined.pids, "seconds": round(total, 3),
                  "phases": {k: round(v, 3) for k, v in sorted(phases.items(),
                                                               key=lambda kv: kv[0] != "join")},
                  "recovery": self._recovered_by or self.faults.mode}
        self.generations.append(record)
        if not self.topo.is_root:
            return
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in record["phases"].items())
        line = (f"in-place recovery: generation {joined.generation} at step {joined.step}: "
                f"rank(s) {joined.replaced} replaced by new process(es) (pid "
                f"{', '.join(str(joined.pids[r]) for r in joined.replaced)}); the others kept "
                f"their processes" + (f", rank(s) {joined.undone} went back one step"
                                      if joined.undone else "")
                + (f", rank(s) {joined.unrebuilt} lost their unfinished parity rebuild"
                   if joined.unrebuilt else "")
                + f"; {record['recovery']} recovery of the replaced shard(s); {total:.2f} s "
                  f"on the survivors ({phases})")
        self.log.say(line)
        if self.config.checkpoint is not None:
            path = os.path.join(self.config.checkpoint.directory, "mpickpt-restarts.log")
            with open(path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {line}\n")

    def _loop(self) -> None:
        cfg = self.config
        while self.step < cfg.num_batches:
            self._trace()
            at = self.reader.state().to_dict()
            batch = self.reader.next()
            if batch is None:
                if self.step == 0:  # on every rank: the same files
                    raise NoTrainingData(
                        f"--raw-data-file {cfg.data.raw_data_file}: fewer "
                        f"{'valid ' if cfg.data.skip_bad_lines else ''}lines than one global "
                        f"batch (--mini-batch-size {cfg.global_batch}): nothing to train")
                self.log.say(f"end of training data after {self.step} batches"
                             + self._leftover_lines())
                return
            self._train(batch, at)
            if self.ckpt is not None:
                if self.parity is not None and self.ckpt.due(self.step):
                    self.parity.settle()  # a snapshot must not copy rows still being rebuilt
                self.ckpt.after_step(self.step, self.reader, cfg.num_batches)
                if self.dumps_pending and self.step % 10 == 0:
                    self._drop_dumps_once_replaced()
            if self.votes[0] > 0:
                self._stop_on_signal()
                return
            self._injected_kill()
            lost = self.faults.loss_after(self.step)
            if lost is not None:
                self._recover(lost)
            if cfg.run.test_freq and self.step % cfg.run.test_freq == 0 \
                    and self.step < cfg.num_batches:
                self.test()

    def _train(self, batch, at: dict) -> None:
        """One step, with the stop vote riding its allreduce. Collective."""
        started = time.perf_counter()
        self.survival.begin_step(self.step + 1, at)
        self.votes[0] = 1.0 if self.signals.requested else 0.0
        loss = self.model.train_step(batch, self.votes)
        with self.model.state_lock:  # a survivor dump sees both or neither
            self.survival.end_step()
            self.step += 1
        self.executed += 1
        self.log.step(self.step, loss, self.config.global_batch)
        seconds = time.perf_counter() - started
        self.report.step(self.step, loss, seconds)
        self.faults.note_step(seconds)
        if self.parity is not None:
            self.parity.note_step(seconds)

    def _boundary(self) -> tuple[int, dict, dict]:
        """(last completed step, reader position there, PLS stats) for a survivor dump."""
        if self._left_at is not None:  # left the generation: the reader is closed
            return self._left_at
        undo = self.survival.undo
        at = undo.current.reader_before if undo is not None and undo.current is not None \
            else self.reader.state().to_dict()
        return self.step, at, self.faults.pls.to_stats()

    def _stop_on_signal(self) -> None:
        """Every rank agreed to stop after this step: write and commit a checkpoint of it
        (unless the interval's just did), then leave the loop. Collective. The times said are
        from the signal's arrival at the rank that got it first (a rank without one measured
        none)."""
        name = self.signals.received or "a peer's stop signal"
        since = self.topo.control.allreduce(self.signals.since(), op="max")
        self.stopped = name
        if self.ckpt is None:
            self.log.say(f"stopping on {name} after step {self.step}: no --ckpt-dir, nothing "
                         f"saved")
            return
        settled = time.perf_counter()
        if self.parity is not None:
            self.parity.settle()  # a rebuild under way finishes first: its time is the stop's
        settled = time.perf_counter() - settled
        if self.ckpt.closed:  # a stop's close came before a peer's death: nothing to save
            newest = self.restorer.newest_step()  # collective; storage, not a manager
            self.stop_committed = newest is not None
            self.log.say(f"stopping on {name} after step {self.step}: the checkpoints were "
                         f"closed by the stop before a peer died; the newest committed is "
                         f"step {newest}")
            return
        start = time.perf_counter()
        self.ckpt.urgent()
        saved = self.ckpt.save_now(self.step, self.reader)
        self.ckpt.settle()  # committed on rank 0 when this returns there
        write = time.perf_counter() - start
        committed = since + settled + write
        self.stop_committed = self.ckpt.newest_committed() == self.step  # collective
        self.ckpt.close()
        if not self.stop_committed:  # its commit was abandoned (logged, never raised)
            self.log.say(stop_failed_message(name, self.step, self.restorer.newest_step(),
                                             self.config.checkpoint.directory))
            return
        self.log.say(f"stopping on {name} after step {self.step}: checkpoint step {self.step} "
                     + ("committed" if saved else "(the interval's) committed")
                     + f" {committed:.2f} s after the signal ({write:.2f} s to write "
                       f"and commit; {since:.2f} s to reach the step boundary"
                     + (f"; {settled:.2f} s to finish the parity rebuild under way"
                        if settled >= 0.005 else "") + ")")

    @property
    def dumps_pending(self) -> bool:
        """Survivor dumps are kept until a newer checkpoint commits. Local."""
        return self.dumps_step is not None

    def _drop_dumps_once_replaced(self) -> None:
        """Survivor dumps restored at the relaunch go once a newer checkpoint commits.
        Collective (`dumps_pending` is the same on every rank)."""
        newest = self.ckpt.newest_committed()
        if newest is not None and newest > self.dumps_step:
            self._drop_dumps(f"checkpoint step {newest} committed")

    def _drop_dumps(self, why: str) -> None:
        self.survival.drop_dump()
        self.log.say(f"survivor dumps of step {self.dumps_step} removed: {why}")
        self.dumps_step = None

    def _finish(self) -> None:
        """The run's end: the rebuild settled, the last checkpoint committed and the writers
        stopped, then the report. Collective. A death in the middle forms a new generation like
        any other; its members then run only the phases the survivors had not completed
        (`finish_done`, agreed when the generation formed), so that all make the same
        collectives. The close ends at a barrier: a member that was still in a close another
        survivor completed (`agreed_end`) finishes it alone, as a replacement stops its idle
        writers instead of a close the survivors already made."""
        for name, phase in (("settle", self._settle), ("close", self._close_checkpoints),
                            ("report", self._report_end)):
            if name in self.finish_done:
                if name == "close":
                    self._closed_elsewhere()
                continue
            phase()
            self.finish_done.append(name)

    def _closed_elsewhere(self) -> None:
        """The close phase counts as done (a replacement, or a survivor that was in its last
        collective when a peer died): stop the writers without a commit (every commit of the
        run is made: a no-op where this rank closed them) and, where the job completed, drop
        the survivor dumps as the close would have. Local."""
        if self.ckpt is not None:
            self.ckpt.abort()
        if self.dumps_pending and self.stopped is None:  # none left where this rank closed
            self._drop_dumps("the job completed")  # after a stop they stay for the survey

    def _settle(self) -> None:
        if self.parity is not None:
            self.parity.settle()

    def _close_checkpoints(self) -> None:
        """The last checkpoint, committed, and the writers stopped. Collective. Its commits end
        at the close's barrier; what follows (the writers stopped, the dumps dropped) is what
        `_closed_elsewhere` does for a member that a death stopped at that barrier or after
        it while another survivor completed the phase (`agreed_end`)."""
        cfg = self.config
        if self.ckpt is not None:
            self.ckpt.urgent()  # training is over: nothing left to yield to
            if cfg.checkpoint.final and self.stopped is None:
                self.ckpt.save_now(self.step, self.reader)
            self.ckpt.close()
            if self.dumps_pending:
                self._drop_dumps_once_replaced()
            if self.dumps_pending and self.stopped is None:
                self._drop_dumps("the job completed")  # nothing resumes from them now

    def _report_end(self) -> None:
        cfg = self.config
        for line in self.faults.summary():
            self.log.say(line)
        skipped = self.skipped_lines()
        if skipped:
            self.log.say(f"--skip-bad-lines: {skipped} malformed line(s) of the training data "
                         f"skipped so far in this job (its reader's position counts them)")
        if self.stopped is None:
            self.test()
            if cfg.run.phase_times:
                self._print_phases()
            if cfg.model.export_dcp:
                self._export_dcp(cfg.model.export_dcp)
            if cfg.run.digest:
                self.log.say(f"digest {self.model.digest()}")
        self.report.finish(self)

    def commit_in_flight(self) -> None:
        """The run stops on a data error, at the same step on every rank: finish and commit
        the checkpoint in flight (of an earlier step, whose state the error did not touch), so
        that a run on mended data resumes from it rather than from the one before. Collective;
        nothing where checkpointing is off or closed already."""
        if self.ckpt is not None and not self.ckpt.closed:
            self.ckpt.close()

    def skipped_lines(self) -> int:
        """Malformed TSV lines the training reader skipped, counted in its position from the
        job's first step on (a resume carries the count), and those among the last lines,
        fewer than a global batch, that the end of the data left untrained; 0 for other
        sources. Local."""
        held = getattr(self.reader.state(), "bad_lines", 0) if self.reader is not None else 0
        return held + self.tail_bad_lines

    def _leftover_lines(self) -> str:
        """At the end of the data: what the lines after the last global batch held (counted
        once, and their malformed ones kept for `skipped_lines`), for the end line; '' where
        none remain or the source cannot say. Local."""
        leftover = getattr(self.source, "leftover", None)
        if leftover is None:
            return ""
        valid, self.tail_bad_lines = leftover(self.reader.state(), self.config.global_batch)
        if valid == 0 and self.tail_bad_lines == 0:
            return ""
        bad = (f"; {self.tail_bad_lines} malformed line(s) among them skipped"
               if self.tail_bad_lines else "")
        return (f" (the last {valid} valid line(s), fewer than a global batch of "
                f"{self.config.global_batch}, not trained on{bad})")

    def _export_dcp(self, path: str) -> None:
        """--export-dcp: the final model as a DCP checkpoint. Collective."""
        from mpickpt.model.torchrec_dcp import save_dcp

        start = time.perf_counter()
        save_dcp(self.model, path, self.step, self.reader.state().to_dict())
        self.log.say(f"exported step {self.step} as DCP checkpoint {path} in "
                     f"{time.perf_counter() - start:.2f} s")

    def _recover(self, lost) -> None:
        """Recover shards lost after this step; a rollback restarts the reader where the
        checkpoint left it. Collective."""
        started = time.perf_counter()
        if self.ckpt is not None:
            self.ckpt.finish_snapshot()  # the recovery rewrites rows a snapshot may still need
        with self.model.state_lock:  # no survivor dump of a half-recovered state
            outcome = self.faults.recover(lost)
            self._recovered_by = outcome.policy
            self.report.recovered(lost, outcome, time.perf_counter() - started, self.executed)
            if outcome.reader_state is not None:
                self.reader.close()
                self.step = outcome.step
                self.reader = self._make_reader(position_from_dict(outcome.reader_state))
                self.log.restart_at(self.step)
                if self.ckpt is not None and self.ckpt.closed:
                    self.log.say(f"steps {self.step + 1}.. replay without checkpoints: the "
                                 f"run's end had closed them")

    def _trace(self) -> None:
        path = self.config.faults.trace_samples
        if path and self.topo.is_root:
            with open(path, "a") as f:
                f.write(f"{self.step + 1} {json.dumps(self.reader.state().to_dict(), sort_keys=True)}\n")

    def test(self) -> None:
        """Evaluate on the test set and print AUC and log loss. Collective."""
        if not self.config.run.test_num_batches:
            return
        result = evaluate(self.model, self.test_source, self.test_start,
                          global_batch=self.config.global_batch,
                          num_batches=self.config.run.test_num_batches)
        self.report.tested(self.step, result)
        if result is None:
            self.log.say(f"test @ step {self.step}: no test samples with both labels")
        else:
            self.log.say(f"test @ step {self.step}: auc {result.auc:.4f}  logloss "
                         f"{result.logloss:.4f}  ({result.samples} samples)")

    def _print_phases(self) -> None:
        steps = max(self.step, 1)
        parts = "  ".join(f"{k} {v / steps * 1e3:.2f}ms" for k, v in sorted(self.timer.totals.items()))
        self.log.say(f"phase times per step (rank 0): {parts}")

    def close(self) -> None:
        """Stop the reader (and the checkpoint writers if `run` did not finish), the peer watch
        and the signal handlers. Local."""
        self.survival.close()
        self.signals.uninstall()
        self.reader.close()
        if self.ckpt is not None:
            self.ckpt.abort()


def _last_error_line(e: BaseException) -> str:
    """The last line that names an error in `e`'s message (DCP's gather every rank's
    traceback into it), else `e` as one line (`error_line`). Local."""
    lines = [line.strip() for line in str(e).splitlines() if "Error" in line]
    return lines[-1] if lines else error_line(e)
