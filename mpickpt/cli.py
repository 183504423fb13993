"""`mpickpt`: list, inspect, verify and export checkpoints written by mpickpt training.

    mpickpt ls DIR
    mpickpt inspect DIR [--step N] [--json]
    mpickpt verify DIR [--step N] [--jobs N]
    mpickpt export DIR [--step N] -o FILE [--with-optimizer]

Local: runs without mpiexec and never imports mpi4py (or torch). Exit status: 0 success, 1 when
verify finds problems or inspect or export meets a damaged checkpoint (a chosen step whose manifest
is damaged included: the file and the problem are named), 2 for usage errors (bad arguments, a
missing directory, an unknown step). Without --step, inspect and export say which newer
checkpoints they passed over and why.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from mpickpt.checkpoint.describe import describe, format_text
from mpickpt.checkpoint.export import export_checkpoint
from mpickpt.checkpoint.load import usable_problems
from mpickpt.checkpoint.verify import verify_checkpoint
from mpickpt.checkpoint.verify_session import VerifySession
from mpickpt.store import unusable
from mpickpt.store.catalog import NoSuchCheckpoint, listing, scan, select
from mpickpt.store.errors import CheckpointError

PROG = "mpickpt"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subparser per command. Local."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("ls", help="list checkpoints with their status (sizes only, fast)")
    p.add_argument("dir", metavar="DIR", help="checkpoint root (--ckpt-dir of training)")
    p = sub.add_parser("inspect", help="describe one checkpoint")
    add_dir_step(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p = sub.add_parser("verify", help="check files, checksums and structure; exit 1 on problems")
    add_dir_step(p, default_help="every committed checkpoint")
    p.add_argument("--jobs", type=_jobs, default=1, metavar="N",
                   help="processes reading checksums in parallel (default: 1)")
    p = sub.add_parser("export", help="write one checkpoint's model as a single HDF5 file")
    add_dir_step(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="HDF5 file to write")
    p.add_argument("--with-optimizer", action="store_true",
                   help="also export sparse and dense optimizer state")
    p.add_argument("--provenance", action="store_true",
                   help="also record kind, ckpt_id, source directory and world size (the export "
                        "then differs between checkpoint kinds)")
    return parser


def add_dir_step(p: argparse.ArgumentParser, default_help: str = "the newest intact one") -> None:
    p.add_argument("dir", metavar="DIR", help="checkpoint root (--ckpt-dir of training)")
    p.add_argument("--step", type=int, default=None,
                   help=f"checkpoint step (default: {default_help})")


def cmd_ls(args) -> int:
    rows = listing(scan(args.dir))
    wide = max([len("KIND")] + [len(r["kind"] or "-") for r in rows])  # the longest kind's name
    print(f"{'STEP':>12}  {'KIND':<{wide}} {'RANKS':>5} {'FILES':>5} {'SIZE_MB':>9}  STATUS")
    for r in rows:
        step = "?" if r["step"] is None else r["step"]
        ranks = "-" if r["world_size"] is None else r["world_size"]
        print(f"{step:>12}  {r['kind'] or '-':<{wide}} {ranks:>5} {r['files']:>5} "
              f"{r['bytes'] / 1e6:>9.2f}  {r['status']}")
    under_way = replacing_note(args.dir)
    if under_way:
        print(f"note: {under_way}")
    aside = unusable.held(args.dir)
    if aside:
        print(f"note: {len(aside)} checkpoint(s) a restore could not use are set aside in "
              f"{unusable.folder_of(args.dir)} ({', '.join(aside)}): no longer committed; "
              f"inspect them, or delete the folder")
    return 0


def replacing_note(root: str) -> str | None:
    """What `ls` says of a chosen start under way (`store.replacing`), or None. Local."""
    from mpickpt.store import replacing
    from mpickpt.store.sealed_json import DamagedRecord

    try:
        resume = replacing.pending(root)
    except (OSError, DamagedRecord) as e:
        return f"{replacing.path_of(root)}: unreadable ({e}); a relaunch resumes the newest"
    if resume is None:
        return None
    return (f"a launch with --resume {resume} ended before it had retired the checkpoints "
            f"past its start ({replacing.path_of(root)}): a relaunch of the same command "
            f"starts there again and retires them")


def choose(cat, step: int | None):
    """`select` for inspect and export: by default the newest checkpoint that can be read, its
    layers included (`usable_problems`). Local."""
    by_step = {m.step: m for m in cat.manifests}
    return select(cat, step, lambda root, m: usable_problems(root, m, by_step))


def cmd_inspect(args) -> int:
    cat = scan(args.dir)
    manifest, note = choose(cat, args.step)
    if note:
        print(f"{PROG}: note: {note}", file=sys.stderr)
    info = describe(args.dir, manifest)
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
    else:
        print("\n".join(format_text(info)))
    return 1 if info["errors"] else 0


def cmd_verify(args) -> int:
    cat = scan(args.dir)
    unreadable = [msg for step, msg in cat.bad_manifests if args.step in (None, step)]
    if args.step is None:
        manifests = cat.manifests
    else:  # a damaged manifest of that step is a problem found, not an unknown step
        manifests = [] if unreadable else [select(cat, args.step)[0]]
    if not manifests and not unreadable:
        select(cat, None)  # raises NoSuchCheckpoint: nothing committed to verify
    bad = len(unreadable)
    for message in unreadable:
        print(f"error: {message}")
    for d in cat.torn:
        print(f"warning: {os.path.join(args.dir, d)}: torn checkpoint directory "
              f"(no manifest refers to it)")
    by_step = {m.step: m for m in cat.manifests}
    start = time.perf_counter()
    with VerifySession(args.jobs) as session:
        for m in manifests:
            problems = verify_checkpoint(args.dir, m, session, by_step)
            bad += bool(problems)
            print("\n".join(f"step {m.step}: {p}" for p in problems) or f"step {m.step}: OK",
                  flush=True)
        rate, total = session.rate(), session.bytes_checked
    seconds = time.perf_counter() - start  # structure and coverage included
    print(summary(len(manifests) + len(unreadable), bad, len(cat.torn))
          + f"; checksums of {rate}; {seconds:.2f} s in all "
          f"({total / 1e6 / max(seconds, 1e-9):.0f} MB/s)")
    return 1 if bad else 0


def _jobs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of processes >= 1, got {text!r}")
    return int(text)


def summary(checked: int, bad: int, torn: int) -> str:
    warn = f", {torn} torn director{'y' if torn == 1 else 'ies'} (warning)" if torn else ""
    return f"{checked} checkpoint(s) checked, {bad} with problems{warn}"


def cmd_export(args) -> int:
    out = args.output
    _check_export_path(out, args.dir)
    cat = scan(args.dir)
    manifest, note = choose(cat, args.step)
    if note:
        print(f"{PROG}: note: {note}", file=sys.stderr)
    result = export_checkpoint(args.dir, manifest, out, with_optimizer=args.with_optimizer,
                               provenance=args.provenance)
    print(f"exported step {manifest.step}: {result['tables']} tables, {result['rows']} rows "
          f"-> {out} ({result['bytes'] / 1e6:.2f} MB)")
    return 0


def _check_export_path(out: str, root: str) -> None:
    """NoSuchCheckpoint (bad input) where the export cannot go to `out`: a directory, a folder
    that is missing or not writable, or a place inside the checkpoint directory `root` (it could
    replace the checkpoint's own files). Local."""
    parent = os.path.dirname(os.path.abspath(out))
    why = ("is a directory" if os.path.isdir(out) else "no such directory"
           if not os.path.isdir(parent) else "its folder is not writable (read-only?)"
           if not os.access(parent, os.W_OK) else None)
    inside = os.path.realpath(parent) + os.sep
    if why is None and inside.startswith(os.path.realpath(root) + os.sep):
        why = f"it is inside the checkpoint directory {root}: export elsewhere"
    if why is not None:
        raise NoSuchCheckpoint(f"{out}: cannot write the export there ({why})")


COMMANDS = {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "export": cmd_export}


def main(argv=None) -> int:
    """Entry point of the `mpickpt` console script and `python -m mpickpt.cli`. Local."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except NoSuchCheckpoint as e:
        return fail(str(e), 2)
    except CheckpointError as e:
        return fail(str(e), 1)
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        return fail(f"{e.filename or args.dir}: {e.strerror or e}", 1)


def fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
