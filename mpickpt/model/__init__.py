"""The hybrid-parallel DLRM: shard plan, sharded embedding bags, sparse optimizers, dense part."""
