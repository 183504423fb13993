"""Input pipeline: synthetic Criteo-like stream, raw Criteo TSV reader, background prefetch.

Every source is stateless and reads rank slices of global batches from a small serializable
position (`SyntheticPosition`, `TSVPosition`), so the global stream and the saved position are the
same on every rank and for every world size.
"""
from mpickpt.data.batch import Batch
from mpickpt.data.criteo_tsv import CriteoFormatError, CriteoTSVConfig, CriteoTSVSource
from mpickpt.data.metrics import log_loss, roc_auc
from mpickpt.data.position import ReaderState, SyntheticPosition, TSVPosition, position_from_dict
from mpickpt.data.prefetch import PrefetchReader
from mpickpt.data.source import SliceSource, local_slice
from mpickpt.data.synthetic import (CRITEO_KAGGLE_CARDINALITIES, SyntheticConfig, SyntheticStream,
                                    criteo_kaggle_sizes)

__all__ = [
    "Batch", "CRITEO_KAGGLE_CARDINALITIES", "CriteoFormatError", "CriteoTSVConfig", "CriteoTSVSource",
    "PrefetchReader", "ReaderState", "SliceSource", "SyntheticConfig", "SyntheticPosition",
    "SyntheticStream", "TSVPosition", "criteo_kaggle_sizes", "local_slice", "log_loss",
    "position_from_dict", "roc_auc",
]
