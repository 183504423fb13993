"""mpickpt: checkpointing and fault tolerance for hybrid-parallel DLRM training over MPI."""
from setuptools import Extension, find_packages, setup

# The CPU kernel of the quantization range search (mpickpt._quant_cpu). Optional: without a C
# compiler the install still succeeds and mpickpt.quant.search falls back to its torch path.
# -ffp-contract=off: no FMAs (clang contracts by default even in ISO C), so decoded rows equal
# numpy's bit for bit on every compiler and machine.
QUANT_CPU = Extension("mpickpt._quant_cpu", sources=["kernels/quant_rows_cpu.c"],
                      extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off"],
                      optional=True)

# The CPU fold of parity deltas (mpickpt._parity_cpu), optional too: mpickpt.parity falls back to
# torch indexing.
PARITY_CPU = Extension("mpickpt._parity_cpu", sources=["kernels/parity_fold_cpu.c"],
                       extra_compile_args=["-O3", "-std=c11"], optional=True)

# The Bloom filter bits of IncrCP's extractor (mpickpt._bloom_cpu), optional too:
# mpickpt.incrcp.bloom falls back to numpy.
BLOOM_CPU = Extension("mpickpt._bloom_cpu", sources=["kernels/bloom_cpu.c"],
                      extra_compile_args=["-O3", "-std=c11"], optional=True)

# Row gathers of the writers and the extractor (mpickpt._rows_cpu), optional too:
# mpickpt.store.row_gather falls back to numpy's take.
ROWS_CPU = Extension("mpickpt._rows_cpu", sources=["kernels/rows_cpu.c"],
                     extra_compile_args=["-O3", "-std=c11"], optional=True)

# The rows of the tracker's set bits (mpickpt._row_bits_cpu), optional too:
# mpickpt.track.bit_rows falls back to numpy.
ROW_BITS_CPU = Extension("mpickpt._row_bits_cpu", sources=["kernels/row_bits_cpu.c"],
                         extra_compile_args=["-O3", "-std=c11"], optional=True)

setup(
    name="mpickpt",
    version="0.1.0",
    description="Checkpointing and fault tolerance for hybrid-parallel recommendation-model training over MPI",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mpickpt", "mpickpt.*"]),
    ext_modules=[QUANT_CPU, PARITY_CPU, BLOOM_CPU, ROWS_CPU, ROW_BITS_CPU],
    package_data={"mpickpt": ["../kernels/*.cu"]},
    # torch is deliberately unpinned here so clusters keep their own CUDA build; on CPU-only machines
    # install with `-c constraints-cpu.txt`, which pins the local CPU build torch==2.13.0.
    # zlib-ng: CRC-32 at 8-13x zlib's speed (mpickpt.store.crc), where it ships wheels; elsewhere
    # (e.g. ppc64le) zlib's CRC is used, same values
    install_requires=["numpy>=1.24", "torch>=2.1", "mpi4py>=3.1", "h5py>=3.8",
                      "zlib-ng>=0.4; platform_machine in 'x86_64 AMD64 aarch64 arm64'"],
    extras_require={
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2", "hypothesis>=6"],
        "gpu": ["cupy-cuda12x>=13"],
        "mpich": ["mpich"],
        "bench": ["matplotlib>=3.6"],
        # torchrec's requirements besides torchrec and fbgemm-gpu themselves, which are installed
        # with --no-deps from requirements-torchrec.txt (see there)
        "torchrec": ["pyre-extensions", "tensordict", "torchmetrics", "tqdm"],
    },
    entry_points={"console_scripts": ["mpickpt-train=mpickpt.train:main",
                                      "mpickpt-run=mpickpt.launch.relaunch:main",
                                      "mpickpt=mpickpt.cli:main"]},
)
