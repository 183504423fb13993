"""Checkpoint stall and background write throughput, against DCP async_save and the raw disk.

    python bench/checkpoint_stall.py --ranks 2 --sizes-mb 32,64,128,256 --repeats 5 --dir /tmp/mpickpt-bench

Launches one `mpiexec -n N` job (this file with --worker) that loops over state sizes. For each size S
(MB of embedding state per rank: weight + rowwise-Adagrad accumulator, D=64, 260 bytes/row) every
rank builds a HybridDLRM, trains 2 steps so optimizer state exists, and then, all on the same
tensors and the same disk:

1. host memcpy bandwidth: best `dst.copy_(src)` of as many bytes as the rank stages, ranks together;
2. mpickpt: CheckpointManager.save() per repeat (after one warm-up save that allocates the staging
   area), stall = wall time of save() (and the engine's own copy time), then poll() every 2 ms
   until rank 0 sees the manifest (the longest poll() is reported: it runs the commit and the
   retention on rank 0); throughput from the manifest's stats (payload bytes / slowest writer
   seconds, all ranks together since they share the disk);
3. DCP: torch.distributed.checkpoint.async_save of {rank<r>/weight, rank<r>/adagrad_sum, dense/...}
   (after one warm-up save), stall = until async_save returns, total = until .result();
4. raw disk: `dd oflag=direct conv=fsync` and buffered `dd conv=fsync` of 2*S MiB on rank 0, and one
   direct dd per rank at once (the disk shared as the writers share it).

Prints a table with the targets (stall <= 1.5 x staged/memcpy; DCP stall / mpickpt stall >= 20;
writer MB/s >= 0.7 x dd direct MB/s), writes bench/results/checkpoint_stall.json and .png. Every
measurement leaves its directory removed. --dir must be on the disk under test (not tmpfs).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mpickpt.engine.config import IO_MODES
from mpickpt.mpiexec import mpiexec

HERE = Path(__file__).resolve().parent
ROW_BYTES = 64 * 4 + 4  # float32 row of D=64 plus the rowwise-Adagrad accumulator
NUM_TABLES = 8
TARGET_STALL_VS_MEMCPY = 1.5
TARGET_DCP_OVER_MPICKPT = 20.0
TARGET_WRITE_VS_DD = 0.7
SEEN_TAG = 7301
"""Control-channel tag of rank 0's "the commit is visible" message."""


# ---- worker side ---------------------------------------------------------------------------------
def build_model(topo, size_mb: float, seed: int = 0):
    """A HybridDLRM whose per-rank row state is about `size_mb` MB, trained 2 steps. Collective."""
    from mpickpt.data.position import SyntheticPosition
    from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
    from mpickpt.model.dense import DenseArch
    from mpickpt.model.hybrid import HybridDLRM
    from mpickpt.model.optimizers import OptimizerConfig

    total_rows = int(topo.world_size * size_mb * 1e6 / ROW_BYTES)
    sizes = tuple(total_rows // NUM_TABLES + (1 if t < total_rows % NUM_TABLES else 0)
                  for t in range(NUM_TABLES))
    arch = DenseArch(num_dense=13, num_tables=NUM_TABLES, dim=64, bottom=(13, 64, 64), top=(64, 1))
    model = HybridDLRM(topo, arch, sizes, OptimizerConfig(kind="adagrad"), seed)
    stream = SyntheticStream(SyntheticConfig(table_sizes=sizes, seed=seed))
    global_batch = 256 * topo.world_size
    for i in range(2):
        batch, _ = stream.read_slice(SyntheticPosition(sample_index=i * global_batch), global_batch,
                                     topo.rank, topo.world_size)
        model.train_step(batch)
    return model


def staged_tensors(model, with_dense: bool) -> dict:
    """What mpickpt's snapshot copies on this rank (row state, plus dense state on rank 0). Local."""
    out = dict(model.row_state())
    if with_dense:
        out.update({f"dense/{k}": v for k, v in model.dense_state().items()})
    return out


def nbytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memcpy_bandwidth(topo, nbytes: int, tries: int = 5) -> float:
    """Best copy bandwidth (bytes/s) for `nbytes` into host memory, all ranks copying at once:
    host to host, or on GPUs device to page-locked host (the copy a stop-the-world snapshot
    makes). Collective."""
    import torch

    cuda = topo.device.type == "cuda"
    src = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=topo.device).uniform_()
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dst.copy_(src)  # fault in both
    best = float("inf")
    for _ in range(tries):
        sync()
        topo.control.Barrier()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        sync()
        best = min(best, time.perf_counter() - start)
    moved = src.numel() * src.element_size()
    del src, dst
    return moved / best


def wait_for_commit(topo, manager, root: str, step: int, lines: list,
                    timeout: float = 600.0) -> tuple[float, float]:
    """Poll the manager (as a training loop would, every 2 ms) until rank 0 sees step's manifest.
    Returns (perf_counter when rank 0 saw it, or when this rank learnt of it; the longest single
    poll() on this rank). Raises if the checkpoint was abandoned. Collective."""
    from mpickpt.store.manifest import manifest_path

    path = manifest_path(root, step)
    deadline = time.monotonic() + timeout
    failure = None
    longest = 0.0

    def poll():
        nonlocal longest
        start = time.perf_counter()
        manager.poll()
        longest = max(longest, time.perf_counter() - start)

    if topo.is_root:
        while not os.path.exists(path):
            poll()
            failure = next((x for x in lines if f"checkpoint step {step} abandoned" in x), None)
            if failure:
                break
            if time.monotonic() > deadline:
                failure = f"no manifest for step {step} after {timeout:.0f} s"
                break
            time.sleep(0.002)
        seen = time.perf_counter()
        for r in range(1, topo.world_size):
            topo.control.isend(True, dest=r, tag=SEEN_TAG)
    else:
        while not topo.control.iprobe(tag=SEEN_TAG):  # until rank 0 saw the commit
            poll()  # delivers this rank's durability report when its writer is done
            time.sleep(0.002)
        topo.control.recv(tag=SEEN_TAG)
        seen = time.perf_counter()
    failure = topo.control.bcast(failure, root=0)
    if failure:
        raise RuntimeError(failure)
    return seen, longest


def measure_mpickpt(topo, model, root: str, repeats: int, writers: int,
                    snapshot: str = "stop-the-world", io: str = "direct") -> dict:
    """Stall, total time and writer throughput of CheckpointManager.save(). Collective."""
    from mpickpt.engine.config import CheckpointConfig
    from mpickpt.engine.manager import CheckpointManager
    from mpickpt.store.manifest import load_manifest, manifest_path

    config = CheckpointConfig(directory=root, interval=1, keep=1, resume="none", writers=writers,
                              snapshot=snapshot, io=io)
    if topo.is_root:
        config.check_directory()
    topo.control.Barrier()
    lines: list[str] = []
    manager = CheckpointManager(topo, config, model, log=lines.append)
    reader_state = {"kind": "synthetic", "sample_index": 0}
    runs = []
    try:
        for step in range(1, repeats + 2):  # step 1 is the warm-up (allocates the staging area)
            if topo.is_root:
                os.sync()  # no dirty pages from earlier phases in the writers' way
            manager.look_ahead(step - 1)  # as after_step(step - 1) of a training loop does
            topo.control.Barrier()
            start = time.perf_counter()
            saved = manager.save(step, reader_state)
            wall = time.perf_counter() - start
            if not saved:
                raise RuntimeError(f"save({step}) was skipped")
            manager.schedule.passed(step)  # as after_step does: the next step is due
            copy = manager.stalls[-1]
            seen, longest_poll = wait_for_commit(topo, manager, root, step, lines)
            per_rank = topo.control.gather({"wall": wall, "copy": copy, "poll": longest_poll}, root=0)
            if topo.is_root:
                m = load_manifest(manifest_path(root, step))
                bytes_by_rank = {}
                for info in m.files.values():
                    bytes_by_rank[info["rank"]] = bytes_by_rank.get(info["rank"], 0) + info["size"]
                runs.append({"step": step, "warmup": step == 1,
                             "stall_wall_s": [r["wall"] for r in per_rank],
                             "stall_copy_s": [r["copy"] for r in per_rank],
                             "poll_max_s": [r["poll"] for r in per_rank],
                             "commit_s": seen - start,
                             "payload_bytes": m.stats["bytes"],
                             "file_bytes": m.total_bytes(),
                             "file_bytes_by_rank": [bytes_by_rank.get(r, 0)
                                                    for r in range(topo.world_size)],
                             "write_seconds": m.stats["write_seconds"],
                             "manifest_stall_s": m.stats["stall_seconds"],
                             "staged_bytes": m.stats["staged_bytes"]})
    finally:
        manager.close()
    topo.control.Barrier()
    if topo.is_root:
        shutil.rmtree(root, ignore_errors=True)
    if not topo.is_root:
        return {}
    timed = [r for r in runs if not r["warmup"]]
    world = topo.world_size
    agg = [r["payload_bytes"] / r["write_seconds"] for r in timed]
    return {"runs": runs, "writers_per_rank": writers,
            "stall_wall_s_by_rank": [med(r["stall_wall_s"][i] for r in timed) for i in range(world)],
            "stall_copy_s_by_rank": [med(r["stall_copy_s"][i] for r in timed) for i in range(world)],
            "stall_wall_s": med(max(r["stall_wall_s"]) for r in timed),
            "stall_copy_s": med(max(r["stall_copy_s"]) for r in timed),
            "poll_max_s": med(max(r["poll_max_s"]) for r in timed),
            "commit_s": med(r["commit_s"] for r in timed),
            "write_seconds": med(r["write_seconds"] for r in timed),
            "payload_bytes": timed[-1]["payload_bytes"], "file_bytes": timed[-1]["file_bytes"],
            "write_MBps_aggregate": med(agg) / 1e6,
            "write_MBps_per_rank": med(a / world for a in agg) / 1e6,
            "first_save_stall_wall_s": max(runs[0]["stall_wall_s"])}


def measure_dcp(topo, model, root: str, repeats: int) -> dict:
    """Stall and total time of DCP async_save on the same tensors. Collective."""
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp

    r = topo.rank
    state = {f"rank{r}/{k.replace('state/', '')}": v for k, v in model.row_state().items()}
    state.update({f"dense/{k}": v for k, v in model.dense_state().items()})  # replicated: DCP dedups
    runs, error = [], None
    kwargs = {}
    if topo.device.type == "cuda":  # async_save's own collectives need a CPU group
        import torch.distributed as dist

        kwargs["process_group"] = dist.new_group(backend="gloo")
    for i in range(repeats + 1):  # i == 0 is the warm-up
        path = os.path.join(root, f"save-{i}")
        if topo.is_root:
            os.sync()
        topo.control.Barrier()
        try:
            start = time.perf_counter()
            response = dcp.async_save(state, checkpoint_id=path, **kwargs)
            stall = time.perf_counter() - start
            if isinstance(response, Future):
                response.result()
            else:  # AsyncSaveResponse (non-blocking stager): staging, then upload
                response.staging_completion.result()
                response.upload_completion.result()
            total = time.perf_counter() - start
            local = {"stall": stall, "total": total}
        except Exception as e:  # reported in the JSON, not fatal
            local = {"error": f"{type(e).__name__}: {e}"}
        results = topo.control.allgather(local)
        errors = [x["error"] for x in results if "error" in x]
        if topo.is_root:
            size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) \
                if os.path.isdir(path) else 0
            shutil.rmtree(path, ignore_errors=True)
        topo.control.Barrier()
        if errors:
            error = errors[0]
            break
        if topo.is_root:
            runs.append({"warmup": i == 0, "stall_s": [x["stall"] for x in results],
                         "total_s": [x["total"] for x in results], "file_bytes": size})
    if topo.is_root:
        shutil.rmtree(root, ignore_errors=True)
        timed = [x for x in runs if not x["warmup"]]
        if error or not timed:
            return {"error": error or "no timed run", "runs": runs}
        return {"runs": runs,
                "stall_s_by_rank": [med(x["stall_s"][j] for x in timed) for j in range(topo.world_size)],
                "stall_s": med(max(x["stall_s"]) for x in timed),
                "total_s": med(max(x["total_s"]) for x in timed),
                "file_bytes": timed[-1]["file_bytes"],
                "write_MBps_aggregate": med(x["file_bytes"] / max(x["total_s"]) for x in timed) / 1e6}
    return {}


DD_LINE = re.compile(r"^(\d+) bytes .*copied, ([0-9.eE+-]+) s", re.M)


def run_dd(path: str, mib: int, direct: bool) -> dict:
    """One dd of `mib` MiB of zeros with fsync (O_DIRECT or buffered); MB/s from dd's own report,
    else from our wall time. Local."""
    count = max(1, mib // 4)
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fsync"]
    if direct:
        cmd.append("oflag=direct")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"))
    wall = time.perf_counter() - start
    try:
        os.remove(path)
    except OSError:
        pass
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "dd failed"}
    m = DD_LINE.search(proc.stderr)
    nbytes, seconds = (int(m.group(1)), float(m.group(2))) if m else (count * 4 << 20, wall)
    return {"bytes": nbytes, "seconds": seconds, "MBps": nbytes / seconds / 1e6}


def measure_disk(topo, root: str, size_mb: float, repeats: int) -> dict:
    """dd direct and buffered on rank 0 (2*S MiB), and one direct dd per rank at once. Collective."""
    os.makedirs(root, exist_ok=True)
    mib = int(round(size_mb * topo.world_size))
    out = {}
    if topo.is_root:
        for kind, direct in (("direct", True), ("buffered_fsync", False)):
            runs = []
            for _ in range(repeats):
                os.sync()
                runs.append(run_dd(os.path.join(root, "dd.tmp"), mib, direct))
            errors = [x["error"] for x in runs if "error" in x]
            out[kind] = {"error": errors[0]} if errors else \
                {"MBps": med(x["MBps"] for x in runs), "runs": runs}
    runs = []
    for _ in range(repeats):
        if topo.is_root:
            os.sync()
        topo.control.Barrier()
        start = time.perf_counter()
        one = run_dd(os.path.join(root, f"dd-{topo.rank}.tmp"), int(round(size_mb)), True)
        one["end"] = time.perf_counter() - start
        runs.append(topo.control.gather(one, root=0))
    topo.control.Barrier()
    if topo.is_root:
        errors = [x["error"] for rr in runs for x in rr if "error" in x]
        out["direct_parallel"] = {"error": errors[0]} if errors else \
            {"MBps": med(sum(x["bytes"] for x in rr) / max(x["end"] for x in rr) for rr in runs) / 1e6,
             "streams": topo.world_size}
        shutil.rmtree(root, ignore_errors=True)
    return out


def med(values) -> float:
    return float(statistics.median(list(values)))


def worker(args) -> None:
    """One rank of the benchmark job: every size in turn. Collective."""
    import torch
    from mpi4py import MPI

    from mpickpt.topology import Topology

    topo = Topology.from_mpi(MPI.COMM_WORLD, backend=args.backend)
    results = []
    for size_mb in [float(s) for s in args.sizes_mb.split(",")]:
        t0 = time.perf_counter()
        model = build_model(topo, size_mb)
        staged = nbytes_of(staged_tensors(model, topo.is_root).values())
        bw = memcpy_bandwidth(topo, staged)
        tag = f"{size_mb:g}mb"
        mp = measure_mpickpt(topo, model, os.path.join(args.dir, f"mpickpt-{tag}"), args.repeats,
                             args.writers, args.snapshot, args.io)
        dc = measure_dcp(topo, model, os.path.join(args.dir, f"dcp-{tag}"), args.repeats)
        disk = measure_disk(topo, os.path.join(args.dir, f"dd-{tag}"), size_mb, args.repeats)
        per_rank = topo.control.gather({"staged_bytes": staged, "memcpy_Bps": bw,
                                        "local_rows": model.plan.local_rows(topo.rank)}, root=0)
        if topo.is_root:
            result = {"size_mb_per_rank": size_mb, "world_size": topo.world_size,
                      "threads": torch.get_num_threads(),
                      "staged_bytes_by_rank": [p["staged_bytes"] for p in per_rank],
                      "local_rows_by_rank": [p["local_rows"] for p in per_rank],
                      "memcpy_GBps_by_rank": [p["memcpy_Bps"] / 1e9 for p in per_rank],
                      "mpickpt": mp, "dcp": dc, "dd": disk,
                      "seconds": time.perf_counter() - t0}
            result["targets"] = targets(result)
            results.append(result)
            print(f"[size {size_mb:g} MB/rank done in {result['seconds']:.1f} s]", flush=True)
        del model
        gc.collect()
    if topo.is_root:
        Path(args.out).write_text(json.dumps(results))
    topo.close()


def targets(r: dict) -> dict:
    """The three ratios of the issue, with their targets. Local."""
    out = {}
    mp, dc, dd = r["mpickpt"], r["dcp"], r["dd"]
    floor = [b / (g * 1e9) for b, g in zip(r["staged_bytes_by_rank"], r["memcpy_GBps_by_rank"])]
    ratio = max(s / f for s, f in zip(mp["stall_wall_s_by_rank"], floor))
    out["stall_vs_memcpy"] = {"value": ratio, "target": f"<= {TARGET_STALL_VS_MEMCPY}",
                              "pass": ratio <= TARGET_STALL_VS_MEMCPY,
                              "memcpy_floor_s_by_rank": floor,
                              "engine_copy_ratio": max(s / f for s, f in
                                                       zip(mp["stall_copy_s_by_rank"], floor))}
    if "stall_s" in dc:
        ratio = dc["stall_s"] / mp["stall_wall_s"]
        out["dcp_over_mpickpt_stall"] = {"value": ratio, "target": f">= {TARGET_DCP_OVER_MPICKPT:g}",
                                         "pass": ratio >= TARGET_DCP_OVER_MPICKPT}
    else:
        out["dcp_over_mpickpt_stall"] = {"value": None, "pass": None, "error": dc.get("error")}
    if "MBps" in dd.get("direct", {}):
        ratio = mp["write_MBps_aggregate"] / dd["direct"]["MBps"]
        out["write_vs_dd"] = {"value": ratio, "target": f">= {TARGET_WRITE_VS_DD}",
                              "pass": ratio >= TARGET_WRITE_VS_DD}
        if "MBps" in dd.get("buffered_fsync", {}):
            out["write_vs_dd"]["vs_buffered_fsync"] = \
                mp["write_MBps_aggregate"] / dd["buffered_fsync"]["MBps"]
    else:
        out["write_vs_dd"] = {"value": None, "pass": None, "error": dd.get("direct", {}).get("error")}
    return out


# ---- launcher side -------------------------------------------------------------------------------
def filesystem_of(path: str) -> dict:
    """Mount point, device and type of the filesystem holding `path` (from /proc/mounts). Local."""
    path = os.path.realpath(path)
    best = {"mount": "", "device": "?", "type": "?"}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, kind = line.split()[:3]
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best["mount"]):
                    best = {"mount": mnt, "device": dev, "type": kind}
    except OSError:
        pass
    return best


def fmt_ratio(t: dict) -> str:
    if t.get("value") is None:
        return f"{'n/a':>6} {'ERR':<4}"
    return f"{t['value']:6.2f} {'PASS' if t['pass'] else 'MISS':<4}"


def print_table(results) -> None:
    head = (f"{'MB/rank':>7} {'memcpy':>7} {'floor':>7} {'stall':>7} {'copy':>7} {'poll':>6} {'commit':>7} "
            f"{'MB/s':>6} {'dcp stall':>9} {'dcp tot':>8} {'dd dir':>7} {'dd buf':>7} "
            f"{'stall/floor':>11} {'dcp/stall':>11} {'MB/s / dd':>11}")
    units = (f"{'':>7} {'GB/s':>7} {'ms':>7} {'ms':>7} {'ms':>7} {'ms':>6} {'s':>7} {'agg':>6} {'ms':>9} "
             f"{'s':>8} {'MB/s':>7} {'MB/s':>7} {'<=1.5':>11} {'>=20':>11} {'>=0.7':>11}")
    print(head)
    print(units)
    print("-" * len(head))
    for r in results:
        mp, dc, dd, t = r["mpickpt"], r["dcp"], r["dd"], r["targets"]
        floor = max(t["stall_vs_memcpy"]["memcpy_floor_s_by_rank"])
        dcp_stall = f"{dc['stall_s'] * 1e3:9.0f}" if "stall_s" in dc else f"{'error':>9}"
        dcp_total = f"{dc['total_s']:8.2f}" if "total_s" in dc else f"{'error':>8}"
        dd_dir = f"{dd['direct']['MBps']:7.0f}" if "MBps" in dd.get("direct", {}) else f"{'err':>7}"
        dd_buf = (f"{dd['buffered_fsync']['MBps']:7.0f}" if "MBps" in dd.get("buffered_fsync", {})
                  else f"{'err':>7}")
        print(f"{r['size_mb_per_rank']:7g} {min(r['memcpy_GBps_by_rank']):7.2f} {floor * 1e3:7.1f} "
              f"{mp['stall_wall_s'] * 1e3:7.1f} {mp['stall_copy_s'] * 1e3:7.1f} "
              f"{mp['poll_max_s'] * 1e3:6.1f} {mp['commit_s']:7.2f} {mp['write_MBps_aggregate']:6.0f} {dcp_stall} {dcp_total} {dd_dir} {dd_buf} "
              f"{fmt_ratio(t['stall_vs_memcpy']):>11} {fmt_ratio(t['dcp_over_mpickpt_stall']):>11} "
              f"{fmt_ratio(t['write_vs_dd']):>11}")
    print("stall: wall time of save() on the slowest rank (median); copy: the engine's own copy time; "
          "floor: staged bytes / memcpy bandwidth;\npoll: longest single poll() while waiting for the "
          "commit (a stall the training loop also sees); commit: save() to manifest on rank 0;\nMB/s agg: "
          "payload bytes of all ranks / slowest writer seconds (ranks write the disk at once);\n"
          "dcp stall/tot: async_save return / .result(), slowest rank; dd: rank 0 alone, "
          "2*S MiB, bs=4M, conv=fsync (dir: oflag=direct).")
    for r in results:
        if "error" in r["dcp"]:
            print(f"DCP at {r['size_mb_per_rank']:g} MB/rank failed: {r['dcp']['error']}")


def plot(results, path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["size_mb_per_rank"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 6.2))
    floor = [max(r["targets"]["stall_vs_memcpy"]["memcpy_floor_s_by_rank"]) * 1e3 for r in results]
    a.plot(sizes, [r["mpickpt"]["stall_wall_s"] * 1e3 for r in results], "o-", label="mpickpt save() stall")
    a.plot(sizes, [r["mpickpt"]["stall_copy_s"] * 1e3 for r in results], "s:", ms=4,
           label="mpickpt copy into staging")
    a.plot(sizes, [r["mpickpt"]["poll_max_s"] * 1e3 for r in results], "x:", color="tab:purple",
           label="mpickpt longest poll() (commit)")
    dcp = [(s, r["dcp"]["stall_s"] * 1e3) for s, r in zip(sizes, results) if "stall_s" in r["dcp"]]
    if dcp:
        a.plot(*zip(*dcp), "^-", color="tab:red", label="DCP async_save stall")
    a.plot(sizes, [f * TARGET_STALL_VS_MEMCPY for f in floor], "k--", lw=1,
           label=f"target: {TARGET_STALL_VS_MEMCPY} x staged / memcpy")
    a.set_yscale("log")
    a.set_xscale("log", base=2)
    a.set_xticks(sizes, [f"{s:g}" for s in sizes])
    a.set_xlabel("state per rank (MB)")
    a.set_ylabel("stall per checkpoint, slowest rank (ms)")
    a.set_title(f"Training stall ({results[0]['world_size']} ranks, median)")
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)

    b.plot(sizes, [r["mpickpt"]["write_MBps_aggregate"] for r in results], "o-",
           label="mpickpt writers, all ranks")
    b.plot(sizes, [r["mpickpt"]["write_MBps_per_rank"] for r in results], "s:", ms=4,
           label="mpickpt writers, per rank")
    dcp = [(s, r["dcp"]["write_MBps_aggregate"]) for s, r in zip(sizes, results)
           if "write_MBps_aggregate" in r["dcp"]]
    if dcp:
        b.plot(*zip(*dcp), "^-", color="tab:red", label="DCP (bytes / total time)")
    for key, style, label in (("direct", "k-", "dd oflag=direct"),
                              ("buffered_fsync", "k-.", "dd buffered + fsync"),
                              ("direct_parallel", "k:", "dd oflag=direct, one per rank")):
        pts = [(s, r["dd"][key]["MBps"]) for s, r in zip(sizes, results) if "MBps" in r["dd"].get(key, {})]
        if pts:
            b.plot(*zip(*pts), style, lw=1.2, label=label)
    pts = [(s, r["dd"]["direct"]["MBps"] * TARGET_WRITE_VS_DD) for s, r in zip(sizes, results)
           if "MBps" in r["dd"].get("direct", {})]
    if pts:
        b.plot(*zip(*pts), "--", color="tab:green", lw=1, label=f"target: {TARGET_WRITE_VS_DD} x dd direct")
    b.set_xscale("log", base=2)
    b.set_xticks(sizes, [f"{s:g}" for s in sizes])
    b.set_ylim(bottom=0)
    b.set_xlabel("state per rank (MB)")
    b.set_ylabel("write throughput (MB/s)")
    b.set_title("Background write throughput vs raw disk")
    b.grid(True, alpha=0.3)
    b.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.suptitle(f"{meta['machine']}, {meta['cpus']} CPUs, {meta['filesystem']['type']} on "
                 f"{meta['filesystem']['device']}, {meta['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes-mb", default="32,64,128,256", help="state per rank, MB, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed saves per size (plus one warm-up)")
    p.add_argument("--writers", type=int, default=1, help="mpickpt writer processes per rank")
    p.add_argument("--dir", default="/tmp/mpickpt-bench",
                   help="scratch directory on the disk under test (not tmpfs)")
    p.add_argument("--snapshot", default="stop-the-world",
                   choices=("stop-the-world", "copy-on-update"),
                   help="mpickpt's --ckpt-snapshot (copy-on-update: the rows are copied after "
                        "save() returns)")
    p.add_argument("--io", default="direct", choices=IO_MODES,
                   help="mpickpt's --ckpt-io (direct: O_DIRECT writes past the page cache)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                   help="nccl: the model on the GPUs (one per rank), the floor a device-to-host "
                        "copy into page-locked memory")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(HERE / "results" / "checkpoint_stall.json"))
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.worker:
        return worker(args)
    fs = filesystem_of(os.path.dirname(os.path.abspath(args.dir)) if not os.path.exists(args.dir)
                       else args.dir)
    if fs["type"] in ("tmpfs", "ramfs"):
        print(f"warning: --dir {args.dir} is on {fs['type']}: that measures memory, not a disk",
              flush=True)
    created = not os.path.exists(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    tmp = HERE / "results" / ".checkpoint_stall.tmp"
    cmd = [mpiexec(), "-n", str(args.ranks), sys.executable, __file__, "--worker", "--out", str(tmp),
           "--sizes-mb", args.sizes_mb, "--repeats", str(args.repeats), "--writers",
           str(args.writers), "--dir", os.path.abspath(args.dir), "--snapshot", args.snapshot,
           "--backend", args.backend, "--io", args.io]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.ranks)))
    start = time.perf_counter()
    try:
        subprocess.run(cmd, check=True, env=env)
    finally:
        if created:
            shutil.rmtree(args.dir, ignore_errors=True)
    results = json.loads(tmp.read_text())
    tmp.unlink()
    meta = {"machine": platform.node(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv), "torch": _torch_version(), "dir": os.path.abspath(args.dir),
            "snapshot": args.snapshot, "backend": args.backend, "io": args.io,
            "filesystem": fs, "omp_num_threads": env["OMP_NUM_THREADS"],
            "elapsed_s": time.perf_counter() - start,
            "targets": {"stall_vs_memcpy": f"<= {TARGET_STALL_VS_MEMCPY}",
                        "dcp_over_mpickpt_stall": f">= {TARGET_DCP_OVER_MPICKPT:g}",
                        "write_vs_dd_direct": f">= {TARGET_WRITE_VS_DD}"},
            "results": results}
    print_table(results)
    out = Path(args.out)
    out.write_text(json.dumps(meta, indent=2))
    png = out.with_suffix(".png")
    plot(results, png, meta)
    print(f"wrote {out} and {png} ({meta['elapsed_s']:.0f} s)")


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "?"


if __name__ == "__main__":
    main()
