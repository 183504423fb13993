"""Variable-size all-to-all of row blocks over the training process group (gloo or NCCL), waited on
through the topology so that a peer's death ends the wait (`Topology.wait`)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_counts(topo, device, counts: list[list[int]]) -> list[list[int]]:
    """Send counts[dst] (a fixed-length int list, same length everywhere) to every rank; returns
    what each source sent to this rank. Collective over `topo.pg`."""
    width = len(counts[0])
    send = torch.tensor(counts, dtype=torch.int64, device=device).reshape(-1)
    recv = torch.empty_like(send)
    topo.wait(dist.all_to_all_single(recv, send, group=topo.pg, async_op=True))
    return recv.view(len(counts), width).tolist()


def exchange_rows(topo, device, blocks: list[torch.Tensor], recv_rows: list[int], width: int,
                  dtype) -> list[torch.Tensor]:
    """Send blocks[dst] ((n_dst, width) each) to every rank; receive recv_rows[src] rows from each.
    Returns the received blocks by source. Collective over `topo.pg`."""
    send_rows = [len(b) for b in blocks]
    send = torch.cat([b.reshape(-1, width).to(dtype) for b in blocks])
    recv = torch.empty(sum(recv_rows), width, dtype=dtype, device=device)
    topo.wait(dist.all_to_all_single(recv, send.contiguous(), recv_rows, send_rows,
                                     group=topo.pg, async_op=True))
    return list(torch.split(recv, recv_rows))

