"""mpickpt: checkpointing and fault tolerance for hybrid-parallel DLRM training over MPI."""
__version__ = "0.1.0"
