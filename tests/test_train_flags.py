"""Flag parsing and validation in process: every bad value is refused before training with a
message naming the flag (or file) and what was expected; `--help` lists every flag by concern with
its default; each flag is declared once, on its config dataclass."""
import argparse
import dataclasses
import os
import re

import pytest

from mpickpt.engine.config import CheckpointConfig
from mpickpt.faults.config import FaultConfig
from mpickpt.recovery.config import RecoveryConfig
from mpickpt.options import field_docs, option_fields
from mpickpt.parity.guard import ParityConfig
from mpickpt.quant.config import QuantConfig
from mpickpt.train_flags import DataConfig, ModelConfig, RunConfig, TrainConfig, build_parser
from tests.launch import SHARED_CRITEO

CONFIGS = (ModelConfig, DataConfig, RunConfig, CheckpointConfig, QuantConfig, ParityConfig,
           RecoveryConfig, FaultConfig)


def config_error(argv, world: int = 2) -> str | None:
    """What `mpickpt-train` would refuse `argv` with on `world` ranks (as train.main does)."""
    try:
        config = TrainConfig.from_args(argv)
        config.check_world(world)
        config.check_root_outputs()  # rank 0's
    except (ValueError, OSError) as e:
        return str(e)
    return None


BAD_INPUTS = [
    (2, ["--mini-batch-size", "0"], r"--mini-batch-size: expected an integer >= 1, got 0"),
    (2, ["--learning-rate", "abc"], r"--learning-rate: expected a number > 0, got 'abc'"),
    (2, ["--learning-rate", "nan"], r"expected a finite number > 0, got 'nan'"),
    (2, ["--optimizer", "adam"], r"--optimizer: invalid choice: 'adam'"),
    (2, ["--arch-mlp-bot", "13-64-8"], r"--arch-mlp-bot must end with the embedding dimension "
                                       r"--arch-sparse-feature-size=16, got 13-64-8"),
    (2, ["--arch-mlp-bot", "10-16"], r"must start with the 13 dense features"),
    (2, ["--arch-mlp-top", "64-2"], r"--arch-mlp-top must end with 1 \(the logit\), got 64-2"),
    (2, ["--arch-mlp-top", "64-x-1"], r"--arch-mlp-top must be dash-separated positive integers"),
    (2, ["--arch-embedding-size", "10-x"], r"--arch-embedding-size must be dash-separated"),
    (2, ["--mini-batch-size", "5"], r"--mini-batch-size 5 is not divisible by the world size 2"),
    (2, ["--arch-embedding-size", "1000-1000", "--max-rows-per-rank", "100"],
     r"rank 0 of 2 would hold 1000 embedding rows, more than max_rows_per_rank=100"),
    (3, ["--arch-embedding-size", "2-1", "--row-wise-threshold", "1", "--mini-batch-size", "6"],
     r"table 0 has 2 rows, .* fewer than the world size 3"),
    (2, ["--data-generation", "criteo-tsv"], r"needs --raw-data-file"),
    (2, ["--data-generation", "criteo-tsv", "--arch-embedding-size", "criteo-kaggle",
         "--raw-data-file", "/nonexistent/day_0"], r"Criteo day file /nonexistent/day_0 does not exist"),
    (2, ["--data-generation", "criteo-tsv", "--arch-embedding-size", "criteo-kaggle",
         "--raw-data-file", "/tmp"], r"Criteo day file /tmp is not a regular file"),
    (2, ["--data-generation", "criteo-tsv", "--raw-data-file", "x"], r"26 categorical features"),
    (1, ["--ckpt-dir", "{tmp}", "--ckpt-kind", "weekly"], r"--ckpt-kind"),
    (1, ["--ckpt-dir", "{tmp}", "--incrcp-ratio", "1.5"], r"--incrcp-ratio"),
    (1, ["--ckpt-dir", "{tmp}", "--ckpt-kind", "incrcp", "--incrcp-hold", "lots"],
     r"--incrcp-hold must be a size in bytes such as 0, 65536, 64K or 1M, got 'lots'$"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-kind", "full", "--incrcp-hold", "1M"],
     r"^--incrcp-hold only applies to --ckpt-kind incrcp; --ckpt-kind full would ignore it$"),
    (1, ["--ckpt-dir", "{tmp}", "--inject-slow-copy", "0.1"], r"--inject-slow-copy slows the "
                                                                r"copy-on-update copier"),
    (1, ["--ckpt-dir", "{tmp}", "--ckpt-snapshot", "copy-on-update", "--inject-slow-copy", "0"],
     r"--inject-slow-copy"),
    (1, ["--ckpt-dir", "{tmp}", "--ckpt-bits", "5"], r"--ckpt-bits"),
    (1, ["--ckpt-dir", "{tmp}", "--ckpt-bits", "auto"], r"needs --node-failure-rate"),
    (2, ["--parity-k", "2"], r"multiple of 3, got 2 ranks"),
    (2, ["--inject-failure", "3:1"], r"--inject-failure needs something to recover from"),
    (2, ["--parity-k", "1", "--inject-failure", "3:0/3:1"], r"--inject-failure names a step twice"),
    (2, ["--parity-k", "1", "--inject-failure", "3:0/x"], r"--inject-failure must look like STEP"),
    (2, ["--parity-k", "1", "--inject-failure", "3:0/5:2"], r"names ranks \[2\], but the world"),
    (2, ["--parity-k", "1", "--inject-failure", "3:2"], r"names ranks \[2\], but the world has 2 "
                                                        r"ranks"),
    (2, ["--inject-kill", "3"], r"--inject-kill must look like STEP:RANK\[,RANK...\], got '3'"),
    (2, ["--inject-kill-settling", "3:1"], r"--inject-kill-settling must look like "
                                           r"RANK\[,RANK...\], got '3:1'"),
    (2, ["--inject-kill-settling", "0,0"], r"--inject-kill-settling names a rank twice"),
    (2, ["--inject-kill-settling", "2"], r"--inject-kill-settling names ranks \[2\], but the "
                                         r"world has 2 ranks"),
    (2, ["--startup-timeout", "0"], r"--startup-timeout: expected a finite number > 0, got '0'"),
    (2, ["--in-place", "maybe"], r"--in-place: invalid choice: 'maybe'"),
    (2, ["--spares", "-1"], r"--spares: expected an integer >= 0, got -1"),
    (2, ["--spares", "one"], r"--spares: expected an integer >= 0, got 'one'"),
    (2, ["--ckpt-dir", "/proc/version"], r"--ckpt-dir /proc/version: exists and is not a "
                                         r"directory"),
    # partial recovery, intervals, prioritized saves, the failure emulator (issue 13)
    (2, ["--ckpt-dir", "{tmp}", "--recovery", "partial", "--target-pls", "1.5"],
     r"--target-pls must lie in \(0, 1\), got '1.5'"),
    (2, ["--ckpt-dir", "{tmp}", "--recovery", "partial", "--target-pls", "0"],
     r"--target-pls must lie in \(0, 1\)"),
    (2, ["--recovery", "partial"], r"--recovery partial needs --ckpt-dir"),
    (2, ["--recovery", "auto", "--mtbf", "100"], r"--recovery auto needs --ckpt-dir"),
    (2, ["--target-pls", "0.1", "--recovery", "partial"], r"needs --ckpt-dir"),
    (2, ["--recovery", "parity"], r"--recovery parity needs --parity-k"),
    (2, ["--ckpt-dir", "{tmp}", "--target-pls", "0.1"], r"--target-pls .* needs --recovery "
                                                        r"partial or auto, not full"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-save-fraction", "0"], r"--ckpt-save-fraction must lie "
                                                              r"in \(0, 1\], got '0'"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-save-fraction", "1.5"], r"--ckpt-save-fraction"),
    (2, ["--failure-model", "weibull:3", "--ckpt-dir", "{tmp}"], r"--failure-model must be "
                                                                 r"exponential:MTBF"),
    (2, ["--failure-model", "gamma:2", "--ckpt-dir", "{tmp}"], r"--failure-model 'gamma:2'"),
    (2, ["--failure-model", "exponential:14h", "--ckpt-dir", "{tmp}"],
     r"--failure-model exponential in hours needs --emulated-hours"),
    (2, ["--failure-fraction", "0.5", "--ckpt-dir", "{tmp}"], r"--failure-fraction .* needs "
                                                              r"--failure-model"),
    (2, ["--failure-fraction", "1.5"], r"--failure-fraction must lie in \(0, 1\]"),
    (2, ["--failure-model", "exponential:100"], r"--failure-model needs something to recover "
                                                r"from"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-interval", "auto"], r"need the job's mean time between "
                                                            r"failures: --mtbf"),
    (2, ["--ckpt-dir", "{tmp}", "--recovery", "partial", "--target-pls", "0.1", "--mtbf", "300",
         "--ckpt-interval", "50"], r"drop --ckpt-interval 50"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-priority", "mfu", "--ckpt-kind", "incrcp"],
     r"--ckpt-priority mfu .* cannot go with --ckpt-kind incrcp"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-priority", "lru"], r"--ckpt-priority: invalid choice"),
    (2, ["--parity-k", "1", "--rebuild-transport", "shm"], r"--rebuild-transport: invalid choice"),
    (2, ["--parity-k", "1", "--rebuild-map", "late"], r"--rebuild-map: invalid choice"),
    (2, ["--mtbf", "0h"], r"--mtbf must be a positive number"),
    (2, ["--mtbf=-3h"], r"--mtbf must be a positive number"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-interval", "often"], r"--ckpt-interval: expected an "
                                                             r"integer >= 1"),
    # flags that would be ignored silently: their mechanism is off, or another kind is chosen
    (2, ["--ckpt-interval", "5"], r"^--ckpt-interval needs --ckpt-dir DIR: checkpointing is off "
                                  r"without it$"),
    (2, ["--ckpt-kind", "incrcp", "--ckpt-bits", "4", "--ckpt-final"],
     r"^--ckpt-final, --ckpt-kind, --ckpt-bits need --ckpt-dir DIR: checkpointing is off "
     r"without them$"),
    (2, ["--parity-r", "2", "--rebuild-budget", "4"], r"^--parity-r, --rebuild-budget need "
                                                      r"--parity-k K"),
    (2, ["--raw-data-file", "x"], r"^--raw-data-file needs --data-generation criteo-tsv: "
                                  r"--data-generation synthetic would ignore it$"),
    (2, ["--data-generation", "criteo-tsv", "--raw-data-file", "x", "--arch-embedding-size",
         "criteo-kaggle", "--zipf-alpha", "1.5", "--num-indices-per-lookup", "3"],
     r"^--num-indices-per-lookup, --zipf-alpha need --data-generation synthetic: "
     r"--data-generation criteo-tsv would ignore them$"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-save-fraction", "0.5"],
     r"^--ckpt-save-fraction only applies to --ckpt-kind priority \(set by --ckpt-priority "
     r"RULE\); --ckpt-kind full would ignore it$"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-kind", "consecutive", "--incrcp-reset", "never",
         "--incrcp-ratio", "0.1"], r"^--incrcp-ratio, --incrcp-reset only apply to --ckpt-kind "
                                   r"incrcp; --ckpt-kind consecutive would ignore them$"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-bits", "auto", "--node-failure-rate", "nan",
         "--expected-train-hours", "5"], r"--node-failure-rate: expected a finite number >= 0"),
    # quantization flags where they would be ignored, and state widths the optimizer cannot take
    (2, ["--ckpt-dir", "{tmp}", "--quant-bins", "10"], r"^--quant-bins only applies to "
     r"--ckpt-bits 8, 4, 3, 2 or auto \(a quantizer\); --ckpt-bits 32 would ignore it$"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-bits", "16", "--ckpt-quant", "kmeans",
         "--quant-search", "greedy"], r"^--ckpt-quant, --quant-search only apply to "
                                      r"--ckpt-bits 8, 4, 3, 2 or auto .*--ckpt-bits 16 would"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-bits", "4", "--ckpt-quant", "kmeans", "--quant-ratio",
         "0.1"], r"^--quant-ratio only applies to --ckpt-quant adaptive; --ckpt-quant kmeans "
                 r"would ignore it$"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-bits", "8", "--quant-bins", "20"],
     r"^--quant-bins only applies to a range search at 2, 3 or 4 bits \(or auto\); --ckpt-bits "
     r"8 would ignore it$"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-bits", "4", "--node-failure-rate", "0.001"],
     r"^--node-failure-rate only applies to --ckpt-bits auto; --ckpt-bits 4 would ignore it$"),
    (2, ["--ckpt-dir", "{tmp}", "--ckpt-state-bits", "8"], r"^--ckpt-state-bits 8 quantizes a "
     r"vector of state per row \(--optimizer momentum\); --optimizer adagrad keeps one value"),
    (2, ["--ckpt-dir", "{tmp}", "--optimizer", "sgd", "--ckpt-state-bits", "16"],
     r"^--ckpt-state-bits 16: --optimizer sgd keeps no optimizer state per row"),
    (2, ["--torchrec-sharding", "row_wise"], r"^--torchrec-sharding needs --model torchrec: "
                                             r"--model dlrm would ignore it$"),
    # outputs written at the end, checked before the run
    (2, ["--run-report", "/nonexistent/r.json"], r"^--run-report /nonexistent/r.json: its "
                                                 r"directory /nonexistent does not exist$"),
    (2, ["--trace-samples", "{tmp}"], r"^--trace-samples .*: exists and is a directory$"),
]


@pytest.mark.parametrize("ranks, flags, message", BAD_INPUTS,
                         ids=[" ".join(b[1]) for b in BAD_INPUTS])
def test_bad_input_is_refused_naming_the_flag(tmp_path, ranks, flags, message):
    import re

    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    error = config_error(["--num-batches", "3", *flags], ranks)
    assert error is not None, flags
    assert re.search(message, error), error


def test_good_flags_build_every_config(tmp_path):
    config = TrainConfig.from_args([
        "--ckpt-dir", str(tmp_path), "--ckpt-kind", "incrcp", "--ckpt-bits", "4", "--parity-k",
        "3", "--inject-failure", "5:1", "--mini-batch-size", "64", "--arch-embedding-size",
        "50-40", "--arch-sparse-feature-size", "8", "--arch-mlp-bot", "13-8",
        "--incrcp-hold", "96M"])
    assert config.checkpoint.incrcp_hold == 96 << 20
    assert config.check_world(4).world_size == 4
    assert config.checkpoint.kind == "incrcp" and config.checkpoint.quant.bits == "4"
    assert config.parity == ParityConfig(k=3) and config.faults.inject_failure.events[0].ranks == (1,)
    assert config.table_sizes == (50, 40) and config.arch.dim == 8 and config.global_batch == 64
    network = TrainConfig.from_args(["--parity-k", "1", "--rebuild-transport", "network"])
    assert network.parity.transport == "network" and config.parity.transport == "auto"
    copy = TrainConfig.from_args(["--parity-k", "1", "--rebuild-transport", "copy"])
    assert copy.parity.transport == "copy" and config.parity.budget == 0.07
    late = TrainConfig.from_args(["--parity-k", "1", "--rebuild-map", "failure"])
    assert late.parity.map == "failure" and config.parity.map == "ahead"
    assert TrainConfig.from_args([]).checkpoint is None and TrainConfig.from_args([]).parity is None


def test_every_option_has_help_and_a_default_shown(capsys):
    parser = build_parser()
    titles = [g.title for g in parser._action_groups]
    for concern in ("model", "data", "training run", "checkpointing", "quantized", "in-memory parity",
                    "fault"):
        assert any(t.startswith(concern) for t in titles), (concern, titles)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--ckpt-interval CKPT_INTERVAL" in text and "(default: 100)" in text
    for cls in CONFIGS:
        docs = field_docs(cls)
        for f, meta in option_fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring (its --help text)"


def test_each_flag_is_declared_once():
    flags = [a.option_strings[0] for a in build_parser()._actions if a.option_strings]
    assert len(flags) == len(set(flags))
    declared = sum(len(option_fields(cls)) for cls in CONFIGS)
    assert declared == len(flags) - 1  # every flag but --help comes from a config field


def test_recovery_flags_build_their_configs(tmp_path):
    config = TrainConfig.from_args([
        "--ckpt-dir", str(tmp_path), "--recovery", "auto", "--failure-model", "cpr:28h",
        "--emulated-hours", "56", "--failure-fraction", "0.125", "--ckpt-interval", "auto",
        "--ckpt-priority", "ssu", "--ckpt-save-fraction", "0.25", "--reschedule-time", "0.1h"])
    assert config.recovery.mode == "auto" and config.recovery.mtbf is None
    assert config.faults.failure_model.mean.value == pytest.approx(28.0)
    assert config.faults.hours_per_step(config.num_batches) == pytest.approx(56 / 1000)
    assert config.checkpoint.kind == "priority" and config.checkpoint.priority == "ssu"
    assert config.checkpoint.auto_interval and config.checkpoint.fixed_interval is None
    assert config.recovery.reschedule.value == 0.1 and config.recovery.pls_target == 0.1
    assert TrainConfig.from_args([]).recovery.resolved_mode(parity=False) == "full"
    assert TrainConfig.from_args([]).recovery.resolved_mode(parity=True) == "parity"


def test_argparse_errors_keep_the_parsers_own_message():
    from mpickpt.options import _reported

    with pytest.raises(argparse.ArgumentTypeError, match="--inject-kill must look like"):
        _reported(FaultConfig.__dataclass_fields__["inject_kill"].metadata[
            "mpickpt.option"]["parse"])("x")
    assert dataclasses.is_dataclass(TrainConfig)


@pytest.mark.skipif(not SHARED_CRITEO.exists(), reason="shared Criteo sample not present")
def test_criteo_files_are_checked_before_training():
    config = TrainConfig.from_args(["--data-generation", "criteo-tsv", "--raw-data-file",
                                    str(SHARED_CRITEO), "--arch-embedding-size", "criteo-kaggle"])
    assert config.data.files(train=True) == (str(SHARED_CRITEO),)


TRAINER_SOURCES = ("engine", "faults", "kinds", "parity", "quant", "recovery", "survivors",
                   "train_flags.py", "trainer.py", "train.py", "stop_signals.py")
OTHER_TOOLS_FLAGS = {"--fmad": "NVRTC", "--signal": "sbatch / srun"}


def test_every_flag_a_message_names_is_declared():
    """Flags are declared once (in the config dataclasses); error and log texts still name them.
    A renamed flag must not leave a message pointing at a flag that no longer exists."""
    import ast
    import pathlib
    import re

    import mpickpt

    known = {s for a in build_parser()._actions for s in a.option_strings}
    root = pathlib.Path(mpickpt.__file__).parent
    named = {}
    for entry in TRAINER_SOURCES:
        for path in ([root / entry] if entry.endswith(".py") else (root / entry).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w{-])",
                                           node.value):
                        named.setdefault(flag, set()).add(path.name)
    assert len(named) > 20  # the scan sees the messages
    stale = {flag: sorted(files) for flag, files in named.items() if flag not in known | set(OTHER_TOOLS_FLAGS)}
    assert not stale, f"messages name flags the trainer does not declare: {stale}"


def test_scripted_losses_fire_once_each_in_step_order():
    from mpickpt.faults.injection import FailureScript

    script = TrainConfig.from_args(["--num-batches", "9", "--parity-k", "1", "--inject-failure",
                                    "7:1/3:0,1"]).faults.inject_failure
    assert isinstance(script, FailureScript)
    assert [(e.step, e.ranks) for e in script.events] == [(3, (0, 1)), (7, (1,))]
    fired = set()
    assert script.due(2, fired) is None
    assert script.due(3, fired).ranks == (0, 1)
    assert script.due(3, fired) is None  # a rollback that replays step 3 does not lose it again
    assert script.due(7, fired).ranks == (1,) and fired == {3, 7}


def test_an_injected_kill_fires_after_its_step_or_when_a_death_breaks_that_step():
    kill = TrainConfig.from_args(["--inject-kill", "30:1,3"]).faults.inject_kill
    assert [kill.due(s, 1) for s in (29, 30, 31)] == [False, True, False]
    assert not kill.due(30, 2)
    # a peer's death seen before this rank's own kill: during step 30 (29 finished) or after it
    assert [kill.due(s, 3, interrupted=True) for s in (28, 29, 30, 31)] == [False, True, True,
                                                                          False]
    assert not kill.due(29, 0, interrupted=True)


@pytest.mark.parametrize("step, generation, killed", [(29, 0, True), (30, 0, True),
                                                      (28, 0, False), (29, 1, False)])
def test_a_death_notice_kills_a_rank_named_for_the_step_it_broke(monkeypatch, step, generation,
                                                                 killed):
    """The watch thread's notice (in place or not) fires the kill; never in a later generation."""
    import signal
    from types import SimpleNamespace

    from mpickpt.faults import injection
    from mpickpt.job_variables import RESTART_VARIABLE
    from mpickpt.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.config = TrainConfig.from_args(["--inject-kill", "30:1"])
    trainer.topo = SimpleNamespace(rank=1, generation=generation, replacement=False)
    muted = []
    trainer.signals = SimpleNamespace(mute_death_notices=muted.append)
    sent = []
    monkeypatch.setattr(injection.os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.delenv(RESTART_VARIABLE, raising=False)
    trainer._on_death_notice()  # before the trainer has a step: nothing to decide yet
    trainer.step = step
    trainer._on_death_notice()
    assert sent == ([signal.SIGKILL] if killed else []) and muted == [10.0, 10.0]



    """--spares and --warm-respawn need in-place recovery under a respawning agent, and spares
    a rank left to train; mpickpt-run -n N launches N + S processes."""
    from mpickpt.launch.relaunch import processes

    agent = {"MPICKPT_AGENT_DIR": "/tmp/a", "MPICKPT_IN_PLACE": "1", "MPICKPT_RESTART": "0"}
    RecoveryConfig(spares=1).check_launcher(agent, 5)
    RecoveryConfig(warm_respawn=True).check_launcher(agent, 4)
    for rec, environ, n, message in [
            (RecoveryConfig(spares=4), agent, 4, r"--spares 4 leaves no rank to train among the "
                                                 r"launch's 4 processes"),
            (RecoveryConfig(spares=1, in_place="off"), agent, 5, r"--spares 1 takes a dead "
                                                                 r"rank's place in place; it "
                                                                 r"needs in-place recovery, not "
                                                                 r"--in-place off"),
            (RecoveryConfig(spares=2), {}, 6, r"--spares 2 needs in-place recovery, which needs "
                                              r"the node agents that mpickpt-run starts "
                                              r"\(MPICH's mpiexec, Open MPI 4's mpirun, srun"),
            (RecoveryConfig(warm_respawn=True), {}, 4, r"--warm-respawn keeps a standby .* not a "
                                                      r"launch without them"),
            (RecoveryConfig(warm_respawn=True, in_place="off"), agent, 4,
             r"--warm-respawn .* needs in-place recovery under mpickpt-run's agents, not "
             r"--in-place off"),
            (RecoveryConfig(in_place="on"), {}, 4, r"--in-place on needs the node agents")]:
        with pytest.raises(ValueError, match=message):
            rec.check_launcher(environ, n)
    assert processes(4, ["--spares", "1", "--parity-k", "3"]) == 5
    assert processes(4, ["--spares=2"]) == 6 and processes(4, []) == 4
    assert processes(None, ["--spares", "1"]) is None  # srun: the allocation's tasks
    assert processes(4, ["--spares", "-1"]) == 4  # the trainer refuses it, naming the flag


def test_recovery_defaults_follow_the_launcher():
    """auto: survivor dumps where mpickpt-run relaunches from them, in-place recovery where a
    node agent respawns; `--in-place on` without such an agent is refused naming the fix."""
    rec = RecoveryConfig()
    agent = {"MPICKPT_AGENT_DIR": "/tmp/a", "MPICKPT_IN_PLACE": "1", "MPICKPT_RESTART": "0"}
    assert (rec.survivor_dumps, rec.in_place) == ("auto", "auto")
    assert rec.dumps_mode(agent, has_checkpoints=True) == "shm"
    assert rec.dumps_mode(agent, has_checkpoints=False) == "off"
    assert rec.dumps_mode({}, has_checkpoints=True) == "off"  # plain mpiexec: nobody relaunches
    assert RecoveryConfig(survivor_dumps="ckpt").dumps_mode({}, True) == "ckpt"
    assert RecoveryConfig(survivor_dumps="shm").dumps_note({}).startswith(
        "--survivor-dumps shm without mpickpt-run: the launcher may kill the survivors")
    assert RecoveryConfig(survivor_dumps="shm").dumps_note(agent) is None
    assert rec.dumps_note({}) is None
    assert RecoveryConfig(survivor_dumps="off").dumps_note({}) is None
    assert RecoveryConfig(in_place="auto").in_place_wanted(agent)
    assert rec.in_place_wanted(agent)  # on by default where an agent respawns
    assert not RecoveryConfig(in_place="off").in_place_wanted(agent)
    assert not rec.in_place_wanted({"MPICKPT_AGENT_DIR": "/tmp/a"})  # an agent told no respawns
    assert not RecoveryConfig(in_place="auto").in_place_wanted({})
    RecoveryConfig(in_place="on").check_launcher(agent)
    rec.check_launcher({})
    with pytest.raises(ValueError, match=r"--in-place on needs the node agents that mpickpt-run "
                                         r"starts"):
        RecoveryConfig(in_place="on").check_launcher({"MPICKPT_RESTART": "0"})


def test_outputs_are_checked_where_they_will_be_written(tmp_path):
    from mpickpt.options import OutputError, check_output

    check_output("--run-report", str(tmp_path / "r.json"), folder=False)
    check_output("--export-dcp", str(tmp_path / "new" / "dcp"), folder=True)  # made by DCP
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match=r"^--export-dcp .*file: exists and is not a directory$"):
        check_output("--export-dcp", str(tmp_path / "file"), folder=True)
    with pytest.raises(OutputError, match=r"its directory .*missing does not exist$"):
        check_output("--run-report", str(tmp_path / "missing" / "r.json"), folder=False)
    with pytest.raises(OutputError, match=r"^--run-report .*file/r.json: its directory "
                                          r".*file exists and is not a directory$"):
        check_output("--run-report", str(tmp_path / "file" / "r.json"), folder=False)
    with pytest.raises(OutputError, match=r"^--ckpt-dir .*file/ckpt: .*file exists and is not a"):
        CheckpointConfig(directory=str(tmp_path / "file" / "ckpt")).check_directory()


def test_a_folder_named_as_the_record_of_a_chosen_start_is_refused_and_never_written_into(
        tmp_path):
    from mpickpt.options import OutputError
    from mpickpt.store import replacing

    (tmp_path / replacing.NAME).mkdir()
    with pytest.raises(OutputError, match=rf"^--ckpt-dir {tmp_path}: .*/\.mpickpt-replacing is "
                                          r"not a file; .*: move it away$"):
        CheckpointConfig(directory=str(tmp_path)).check_directory()
    with pytest.raises(IsADirectoryError):
        replacing.begin(str(tmp_path), "40", 40)
    assert os.listdir(tmp_path) == [replacing.NAME]  # no temporary left behind


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_checkpoint_without_a_model_entry_is_refused_before_training(tmp_path):
    pytest.importorskip("torchrec")
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"weights": torch.zeros(3)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    error = config_error(["--model", "torchrec", "--import-dcp", str(tmp_path / "plain")], 1)
    assert error is not None, error
    assert re.search(r"^--import-dcp .*plain: a DCP checkpoint without a 'model' entry \(it "
                     r"holds \['weights'\]\)", error), error


def test_the_native_model_s_placement_flags_are_refused_with_torchrec():
    pytest.importorskip("torchrec")
    error = config_error(["--model", "torchrec", "--max-rows-per-rank", "1000"], 1)
    assert error == ("--max-rows-per-rank needs --model dlrm: --model torchrec places its tables "
                     "by --torchrec-sharding and would ignore it"), error
