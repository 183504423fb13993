"""The extractor: one spawned process per rank that ingests incrcp chunks in the background.

Like the writers it never imports mpi4py or torch and dies with its parent. It receives one job per
committed-to-disk incremental checkpoint, in step order, and answers with the extraction's
statistics and a measured restore time of that checkpoint's increments (IncrCP's cost model input).
Ingestion is idempotent, so a restarted extractor can be handed the same jobs again.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

from mpickpt.background import die_with_parent, error_line, ignore_job_signals, serve


def extractor_main(conn, parent_pid: int, root: str, ratio: float) -> None:
    """Serve ingestion jobs until a None job or a closed pipe. Runs in the extractor process."""
    die_with_parent(parent_pid)
    ignore_job_signals()
    from mpickpt.incrcp.extraction import Extractor

    from mpickpt.incrcp.restore_probe import RestoreProbe

    state = {"extractor": Extractor(root, ratio), "indexes": {}, "probe": RestoreProbe()}
    serve(conn, lambda job: run_ingest(job, state))


def run_ingest(job: dict, state: dict) -> dict:
    """Ingest one column and time a restore of its checkpoint's increments. Local."""
    cpu = time.process_time()
    answer = _ingest(job, state)
    answer["cpu_seconds"] = time.process_time() - cpu  # this job's own, not the start-up's
    return answer


def _ingest(job: dict, state: dict) -> dict:
    from mpickpt.incrcp.extraction import remove_orphans
    from mpickpt.incrcp.held_bundle import HOLD_BYTES
    from mpickpt.store.chunk_index import load_index
    from mpickpt.store.manifest import list_manifests

    root, chain, rank, step = job["root"], job["chain"], job["rank"], job["step"]
    reader = None
    try:
        key = (chain, rank)
        if key not in state["indexes"]:
            state["extractor"].forget_files()  # the old chain's files, which retention deletes
            state["indexes"] = {key: load_index(root, chain, rank)}  # one chain at a time
            remove_orphans(root, state["indexes"][key])
        index = state["indexes"][key]
        state["extractor"].limit_held(job.get("hold", HOLD_BYTES))
        reader = state["extractor"].reader()  # column files open from column_refs to ingest
        refs = column_refs(root, chain, rank, step, job["parts"], reader.file)
        retained = [m.step for m in list_manifests(root) if m.chain == chain]
        hook = _crash if job.get("crash_before_commit") else None
        stats = state["extractor"].ingest(index, step, refs, job["row_names"], retained, hook,
                                          job.get("align", 0), job.get("io") == "direct", reader)
        seconds, timed = restore_seconds(state, job, index)
        return {"ok": True, "step": step, "chain": chain, "stats": stats.as_dict(),
                "restore_seconds": seconds, "restore_timed": timed}
    except Exception as e:  # reported to the trainer, never raised there
        if reader is not None:
            reader.close()
        state["extractor"].forget_files()  # reopened and checked again next time
        state["indexes"].pop((chain, rank), None)  # reload the committed index next time
        _remove_debris(root, chain, rank)
        detail = error_line(e)
        return {"ok": False, "step": step, "chain": chain, "error": f"ingesting step {step}: {detail}"}


def _remove_debris(root: str, chain: str, rank: int) -> None:
    """After a failed ingestion: its temporaries and the bundles no committed index names,
    at once (they would wait for the chain's next ingestion, which may never come: a full
    disk's next checkpoints are baselines of new chains). Nothing where that fails too. Local."""
    from mpickpt.incrcp.extraction import remove_orphans
    from mpickpt.store.chunk_index import load_index

    try:
        remove_orphans(root, load_index(root, chain, rank))
    except Exception:  # the next ingestion of the chain, or the next run, removes them
        pass


def restore_seconds(state: dict, job: dict, index) -> tuple[float | None, bool]:
    """(R of the job's checkpoint for the cost model, whether it was timed): None when the job
    asks for none (`--incrcp-reset never`), else by the extractor's `RestoreProbe`. Local."""
    if not job.get("time_restore", True):
        return None, False
    rows = sum(r.rows for r in index.rectangle(job["step"]))
    return state["probe"].restore_seconds(job["chain"], rows, lambda: time_restore(
        job["root"], index, job["step"], job["row_names"]))


def column_refs(root: str, chain: str, rank: int, step: int, parts: int, opener=None) -> list:
    """ChunkRefs of every table's rows in the column files of checkpoint `step`. `opener(rel)`:
    opens a file under `root` and keeps it open (default: opened and closed here). Local."""
    from mpickpt.store.chunk_index import ChunkRef
    from mpickpt.store.file_spec import column_relpath
    from mpickpt.store.shard_file import open_shard
    from mpickpt.store.tables import table_pieces

    refs = []
    for j in range(parts):
        rel = column_relpath(chain, rank, step, j)
        f = opener(rel) if opener else open_shard(os.path.join(root, rel))
        with contextlib.nullcontext(f) if opener else f:
            for p in table_pieces(f):
                if p.rows:  # a packed file's pieces share its group; per-table groups are implied
                    refs.append(ChunkRef(rel, p.table, p.start, p.stop, p.gid_min, p.gid_max,
                                         step, group=p.group.name.lstrip("/") if p.packed else ""))
    return refs


def time_restore(root: str, index, step: int, row_names: list[str]) -> float:
    """Seconds to read checkpoint `step`'s rectangle of this rank's lists the way restore reads it
    (nearby chunks of a file merged into one read). Local."""
    from mpickpt.store.segments import SegmentReader, merge_refs

    start = time.perf_counter()
    with SegmentReader(root) as reader:
        for seg in merge_refs(index.rectangle(step)):
            for _, group, a, b, _, _ in reader.groups(seg):
                reader.gids(seg, group, a, b)
                for name in row_names:
                    reader.rows(seg, group, name, a, b)
    return time.perf_counter() - start


def _crash() -> None:
    """Fault injection: die by SIGKILL after the bundles are written, before the index commit."""
    os.kill(os.getpid(), signal.SIGKILL)
