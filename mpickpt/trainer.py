"""The synchronous training loop: reader -> hybrid step -> progress, tests, digest."""
from __future__ import annotations

import json
import time

from mpickpt.data.criteo_tsv import CriteoTSVConfig, CriteoTSVSource
from mpickpt.data.position import SyntheticPosition, TSVPosition, position_from_dict
from mpickpt.data.prefetch import PrefetchReader
from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
from mpickpt.engine.manager import CheckpointManager
from mpickpt.engine.restorer import Restorer
from mpickpt.evaluation import evaluate
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.parity.guard import ParityGuard
from mpickpt.progress import ProgressLog
from mpickpt.recovery.tolerance import FaultTolerance
from mpickpt.run_report import RunReport
from mpickpt.timing import PhaseTimer

# The synthetic test set is the same planted stream far beyond any training index.
SYNTHETIC_TEST_OFFSET = 1 << 48


def make_sources(config):
    """(train source, its start state, test source, its start state). Local."""
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
    test = source(data.files(train=False)) if data.files(train=False) else train
    return train, TSVPosition(), test, TSVPosition()


class Trainer:
    """Owns the model, the reader, the checkpoint manager and the loop. `run` is collective."""

    def __init__(self, topo, config, log: ProgressLog | None = None):
        self.topo, self.config = topo, config
        self.timer = PhaseTimer(topo.device, enabled=config.run.phase_times)
        self.model = HybridDLRM(topo, config.arch, config.table_sizes, config.optim,
                                config.model.seed, config.plan_options, self.timer)
        self.log = log or ProgressLog(topo.is_root, config.num_batches, config.run.print_freq)
        self.source, start, self.test_source, self.test_start = make_sources(config)
        first = start.to_dict()
        self.ckpt = self.restorer = restored = None
        self.step = 0
        if config.checkpoint is not None:
            self.ckpt = CheckpointManager(topo, config.checkpoint, self.model, self.log.say)
            self.restorer = Restorer(topo, config.checkpoint.directory, self.model, self.ckpt.say,
                                     config.checkpoint.resume)
            restored = self.restorer.restore()  # collective
            if restored is not None:
                self.ckpt.restored(restored)
                self.step, start = restored.step, position_from_dict(restored.reader_state)
        self.parity = None
        if config.parity is not None:
            self.parity = ParityGuard(topo, self.model, config.parity, self.log.say)
            self.parity.encode()  # collective
        self.faults = FaultTolerance(config, topo, self.model, self.ckpt, self.restorer,
                                     self.parity, self.log.say, restored, first)
        self.reader = self._make_reader(start)
        self.log.restart_at(self.step)
        self.report = RunReport(config.run.run_report, topo.is_root, self.step)
        self.executed = 0

    def _make_reader(self, start) -> PrefetchReader:
        cfg = self.config
        allowance = self.ckpt.allowance(self.step, cfg.num_batches) if self.ckpt else None
        return PrefetchReader(self.source, global_batch=cfg.global_batch, rank=self.topo.rank,
                              world=self.topo.world_size, state=start,
                              depth=cfg.data.prefetch_depth,
                              allowance=allowance)

    def run(self) -> None:
        """Train up to `num_batches` steps (or to the end of the data). Collective."""
        cfg = self.config
        while self.step < cfg.num_batches:
            self._trace()
            batch = self.reader.next()
            if batch is None:
                self.log.say(f"end of training data after {self.step} batches")
                break
            started = time.perf_counter()
            loss = self.model.train_step(batch)
            self.step += 1
            self.log.step(self.step, loss, cfg.global_batch)
            seconds = time.perf_counter() - started
            self.executed += 1
            self.report.step(self.step, loss, seconds)
            self.faults.note_step(seconds)
            if self.parity is not None:
                self.parity.note_step(seconds)
            if self.ckpt is not None:
                if self.parity is not None and self.ckpt.due(self.step):
                    self.parity.settle()  # a snapshot must not copy rows still being rebuilt
                self.ckpt.after_step(self.step, self.reader, cfg.num_batches)
            if cfg.faults.inject_kill is not None:
                cfg.faults.inject_kill.maybe_kill(self.step, self.topo.rank)
            lost = self.faults.loss_after(self.step)
            if lost is not None:
                self._recover(lost)
            if cfg.run.test_freq and self.step % cfg.run.test_freq == 0 \
                    and self.step < cfg.num_batches:
                self.test()
        if self.parity is not None:
            self.parity.settle()
        if self.ckpt is not None:
            self.ckpt.close()
        for line in self.faults.summary():
            self.log.say(line)
        self.test()
        if cfg.run.phase_times:
            self._print_phases()
        if cfg.run.digest:
            self.log.say(f"digest {self.model.digest()}")
        self.report.finish(self)

    def _recover(self, lost) -> None:
        """Recover shards lost after this step; a rollback restarts the reader where the
        checkpoint left it. Collective."""
        started = time.perf_counter()
        outcome = self.faults.recover(lost)
        self.report.recovered(lost, outcome, time.perf_counter() - started, self.executed)
        if outcome.reader_state is not None:
            self.reader.close()
            self.step = outcome.step
            self.reader = self._make_reader(position_from_dict(outcome.reader_state))
            self.log.restart_at(self.step)

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
        """Stop the reader (and the checkpoint writers if `run` did not finish). Local."""
        self.reader.close()
        if self.ckpt is not None:
            self.ckpt.abort()
