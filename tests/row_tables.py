"""RowTables: what CopyOnUpdate needs of a model (`embeddings.add_update_hook`, `state_lock`)
over plain row-aligned tables on any device, and one step's sparse update with its hooks called
first, as ShardedEmbeddingBags.apply_gradients calls them (a test harness of the copy-on-update
mechanism; the trainer's models are tested end to end elsewhere)."""
import threading

import torch


class RowTables:
    def __init__(self, tables: dict[str, torch.Tensor]):
        self.tables, self.hooks = tables, []
        self.state_lock = threading.RLock()
        self.embeddings = self

    def add_update_hook(self, hook) -> None:
        self.hooks.append(hook)

    def update(self, rows: torch.Tensor) -> None:
        """Add one to every value of `rows` in every table, the hooks told first."""
        for hook in self.hooks:
            hook.before_update(rows)
        with self.state_lock:
            for t in self.tables.values():
                if t.dtype == torch.uint8:
                    t[rows] += 1
                else:
                    t[rows] += torch.ones_like(t[rows])
