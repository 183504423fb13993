#!/usr/bin/env bash
# Every GPU check of the project in one run, for a machine with one CUDA GPU (a lent device or a
# cluster node): the CUDA kernel tests, the GPU benchmarks, and NCCL training with checkpoints,
# incrcp, 4-bit quantization and a resume + verify. Logs and JSON land in $OUT (default
# /tmp/mpickpt-gpu). Python packages missing there can travel as wheels in .whl/ (installed into
# /tmp/site). Usage: OUT=dir bash bench/gpu_checks.sh [section ...]
#   sections: env tests bench train cou parity2 stall parity_cores lost_cores
#   (default: all but the last three)
#   parity_cores, lost_cores: CPU benchmarks on the node's own cores, which ranks of one thread
#   each leave free, on the CPU (CUDA_VISIBLE_DEVICES empty: gloo): bench/parity.py (4 ranks;
#   PARITY_SWEEPS, default beside,lookup; PARITY_BUDGETS, default 0.07, the trainer's) and
#   bench/time_lost.py (LOST_RANKS, default 2; LOST_STEPS, default 400)
#   cou: COU_SCALE_DOWN (Criteo Kaggle tables / this, default 2) and COU_PAIRS (default 1)
#   stall: STALL_SIZES_MB (default 64,256,1024) and STALL_MODES (default both snapshot modes)
set -u
OUT=${OUT:-/tmp/mpickpt-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
sections=${*:-env tests bench train cou parity2}
ck=${CKPT_ROOT:-/dev/shm/mpickpt-gpu}

section() { echo; echo "=== $1 ($(date +%T))"; }
ran() { echo "--- $1: rc=$2"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH LD_LIBRARY_PATH=/tmp/site/lib:${LD_LIBRARY_PATH:-}
else
    export PYTHONPATH=$PWD
fi
python3 setup.py -q build_ext --inplace >/tmp/mpickpt-build.log 2>&1; ran build_ext $?
train="python3 -m mpickpt.train"

for s in $sections; do case $s in
env)
    section env
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 - <<'EOF'
import torch, cupy, h5py, numpy
from mpi4py import MPI
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(),
      "| cupy", cupy.__version__, "| h5py", h5py.__version__, "| numpy", numpy.__version__)
print("MPI:", MPI.Get_library_version().splitlines()[0])
from mpickpt.quant import search
from mpickpt.parity import stripe_code
print("C kernels:", search.c_kernel() is not None, stripe_code._cpu_fold() is not None)
EOF
    ;;
tests)
    section tests
    files=$(ls tests/test_*cuda*.py tests/test_row_tracking.py tests/test_topology.py)
    timeout 300 python3 -m pytest -q -p no:cacheprovider --timeout 240 -rs $files 2>&1 | tee "$OUT/tests.log" | tail -40
    ran tests "${PIPESTATUS[0]}"
    ;;
bench)
    section "bench quant_gpu"
    timeout 240 python3 bench/quant_gpu.py --rows 2000000 --out "$OUT/quant_gpu_h100.json"
    ran quant_gpu $?
    section "bench parity_fold_gpu"
    timeout 240 python3 bench/parity_fold_gpu.py --out "$OUT/parity_fold_h100.json"
    ran parity_fold_gpu $?
    ;;
train)
    section "NCCL training: incrcp, 4-bit, checkpoints every 25 steps"
    rm -rf "$ck"
    common="--backend nccl --arch-embedding-size criteo-kaggle --embedding-scale-down 4
            --mini-batch-size 8192 --print-freq 50 --ckpt-dir $ck --ckpt-interval 25"
    timeout 200 $train $common --num-batches 150 --ckpt-kind incrcp --ckpt-bits 4 \
        --ckpt-quant adaptive --ckpt-final 2>&1 | tee "$OUT/train.log" | grep -v "^step .*samples/s" | tail -25
    ran train "${PIPESTATUS[0]}"
    grep "samples/s" "$OUT/train.log" | tail -3
    section "NCCL resume from the newest checkpoint, 50 more steps, full kind"
    timeout 120 $train $common --num-batches 200 --resume latest --ckpt-kind full 2>&1 \
        | tee "$OUT/resume.log" | tail -12
    ran resume "${PIPESTATUS[0]}"
    section "mpickpt verify"
    timeout 120 python3 -m mpickpt.cli verify "$ck" 2>&1 | tail -8
    ran verify "${PIPESTATUS[0]}"
    ;;
parity2)
    section "2 ranks on one GPU with NCCL and parity (NCCL refuses a duplicate GPU: recorded)"
    launch=mpiexec  # the launcher of the MPI that mpi4py loads
    if python3 -c "from mpi4py import MPI; assert 'Open MPI' in MPI.Get_library_version()" 2>/dev/null; then
        launch="$(command -v /usr/bin/mpirun || command -v mpirun) --allow-run-as-root --oversubscribe
                -x PATH -x PYTHONPATH -x LD_LIBRARY_PATH -x PYTHONUNBUFFERED"
    fi
    timeout 90 $launch -n 2 "$(python3 -c 'import sys; print(sys.executable)')" -m mpickpt.train --backend nccl --num-batches 60 --parity-k 1 --parity-r 1 \
        --inject-failure 30:1 --mini-batch-size 1024 2>&1 | tee "$OUT/parity2.log" | tail -15
    ran parity2 "${PIPESTATUS[0]}"
    ;;
cou)
    section "NCCL training: no checkpoints, stop-the-world and copy-on-update snapshots (time lost)"
    scale=${COU_SCALE_DOWN:-2}
    for pair in $(seq 1 ${COU_PAIRS:-1}); do
    for snap in none stop-the-world copy-on-update; do
        rm -rf "$ck-$snap"
        ckpt=""
        [ $snap != none ] && ckpt="--ckpt-dir $ck-$snap --ckpt-interval 60 --ckpt-snapshot $snap"
        timeout 150 $train --backend nccl --arch-embedding-size criteo-kaggle --embedding-scale-down $scale \
            --mini-batch-size 8192 --num-batches 240 --print-freq 80 --run-report "$OUT/cou_${snap}_$pair.json" \
            $ckpt 2>&1 | tee "/tmp/cou_$snap.log" | grep -E "checkpoints:|Error|error" | tail -3
        ran "train $snap (pair $pair)" "${PIPESTATUS[0]}"
    done
    done
    python3 - "$OUT" <<'EOF'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/cou_none_*.json")):
    pair = path.rsplit("_", 1)[1][:-5]
    runs = {s: json.load(open(f"{sys.argv[1]}/cou_{s}_{pair}.json"))
            for s in ("none", "stop-the-world", "copy-on-update")}
    base = runs["none"]["loop_seconds"]
    for s, r in runs.items():
        n, saves = r.get("checkpoints", 0), r.get("save_seconds") or [0]
        lost = (r["loop_seconds"] - base) / n if n else 0.0
        print(f"pair {pair} {s:>15}: loop {r['loop_seconds']:.2f} s, {n} checkpoints, lost "
              f"{lost * 1e3:.0f} ms per checkpoint, save calls (ms) "
              f"{' '.join(f'{x * 1e3:.1f}' for x in saves)}")
EOF
    timeout 120 python3 -m mpickpt.cli verify "$ck-copy-on-update" 2>&1 | tail -1
    ran "verify copy-on-update" "${PIPESTATUS[0]}"
    ;;
stall)
    section "checkpoint stall on the GPU: stop-the-world and copy-on-update against DCP async_save"
    # Open MPI as root, and the variables the ranks need (bench/checkpoint_stall.py launches mpiexec)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        OMPI_MCA_mca_base_env_list="PYTHONPATH;LD_LIBRARY_PATH;PYTHONUNBUFFERED"
    for snap in ${STALL_MODES:-stop-the-world copy-on-update}; do
        timeout 300 python3 bench/checkpoint_stall.py --ranks 1 --backend nccl --snapshot $snap \
            --sizes-mb ${STALL_SIZES_MB:-64,256,1024} --repeats 3 --dir /tmp/mpickpt-stall \
            --out "$OUT/stall_gpu_$snap.json" 2>&1 | tail -9
        ran "stall $snap" "${PIPESTATUS[0]}"
    done
    ;;
parity_cores|lost_cores)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        OMPI_MCA_mca_base_env_list="PYTHONPATH;LD_LIBRARY_PATH;PYTHONUNBUFFERED"
    if [ $s = parity_cores ]; then
    section "free cores: parity rebuild against restore + replay, 4 gloo ranks on $(nproc) cores"
    CUDA_VISIBLE_DEVICES= timeout 250 python3 bench/parity.py --repeats 1 --budgets ${PARITY_BUDGETS:-0.07} --rebuild-repeats 3 \
        --sweeps ${PARITY_SWEEPS:-beside,lookup} \
        --out "$OUT" --name parity_cores 2>&1 | tail -14
    ran "parity (free cores)" "${PIPESTATUS[0]}"
    else
    section "free cores: training time lost per checkpoint, copy-on-update, idle background"
    mkdir -p /tmp/mpickpt-lost
    CUDA_VISIBLE_DEVICES= timeout 240 python3 bench/time_lost.py --ranks ${LOST_RANKS:-2} --rounds 2 \
        --steps ${LOST_STEPS:-400} --kinds full,incrcp,incrcp-4bit --backgrounds idle \
        --snapshots copy-on-update --ios direct --dir /tmp/mpickpt-lost \
        --out "$OUT/time_lost_cores.json" 2>&1 | tail -16
    ran "time lost (free cores)" "${PIPESTATUS[0]}"
    fi
    ;;
*) echo "unknown section $s"; exit 2 ;;
esac; done
