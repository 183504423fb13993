"""On-disk checkpoints: HDF5 shard files, manifests, restore, retention, verification, export."""
