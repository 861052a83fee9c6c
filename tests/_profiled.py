"""A small gloo program that profiles its own communication and exports one Chrome trace per
rank (``torch.profiler``, ``record_shapes=True``) into the folder given as its argument: what
``paraloom import`` reads (``tests/test_import_trace.py``)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        x = torch.ones(8)
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(8 * world), torch.ones(8))
        dist.broadcast(torch.ones(5, dtype=torch.float64), src=0)
        if rank == 0:
            dist.send(torch.ones(3), 1)
        elif rank == 1:
            dist.recv(torch.ones(3), 0)
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * world))
        dist.all_reduce(torch.ones(2, 3, dtype=torch.int64))
        dist.barrier()
    prof.export_chrome_trace(f"{out}/trace_rank{rank}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
