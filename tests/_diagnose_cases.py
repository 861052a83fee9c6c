"""Small programs that break the way parallel jobs break, one per failure class (4 gloo ranks).

    paraloom record --nproc 4 --hang-after 3 -- tests/_diagnose_cases.py CASE
    torchrun --nproc-per-node 4 tests/_diagnose_cases.py CASE --fr DIR   # Flight Recorder dumps

Each case names its culprit and the line where that rank's program diverges (``CASES``), which
the tests and ``benchmarks/diagnose_vs_fr.py`` compare with what a diagnosis says. With
``--fr DIR`` (and ``TORCH_FR_BUFFER_SIZE`` set) every rank dumps its Flight Recorder buffer to
``DIR/fr_RANK`` after ``--dump-after`` seconds, as a watchdog would during a hang.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

CULPRIT = {"skip": 3, "size": 1, "dtype": 2, "op": 1, "root": 2, "order": 3, "p2p": 1,
           "alltoall": 2, "condition": 3, "ddp": 1, "fsdp": 1, "pipeline": 2, "ok": None}
"""Each case's culprit rank (``None``: a healthy program)."""


def marker(name: str) -> int:
    """The line of this file that holds ``# <name>`` (the divergent line of a case)."""
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# <{name}>"):
                return number
    raise KeyError(name)


def case_ok(rank, world):
    x = torch.ones(8)
    for _ in range(3):
        dist.all_reduce(x)
    dist.all_gather_into_tensor(torch.empty(8 * world), torch.ones(8))
    dist.broadcast(x, src=0)


def case_skip(rank, world):
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank != 3:
        dist.all_reduce(x)  # <skip>
    dist.barrier()


def case_size(rank, world):
    dist.all_reduce(torch.ones(4))
    n = 120 if rank == 1 else 100
    dist.all_reduce(torch.ones(n))  # <size>
    dist.all_reduce(torch.ones(4))


def case_dtype(rank, world):
    dist.all_reduce(torch.ones(4))
    dtype = torch.float64 if rank == 2 else torch.float32
    dist.all_reduce(torch.ones(16, dtype=dtype))  # <dtype>
    dist.all_reduce(torch.ones(4))


def case_op(rank, world):
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        dist.all_gather_into_tensor(torch.empty(8 * world), torch.ones(8))  # <op>
    else:
        dist.all_reduce(torch.ones(8))
    dist.all_reduce(torch.ones(4))


def case_root(rank, world):
    dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(4), src=1 if rank == 2 else 0)  # <root>
    dist.all_reduce(torch.ones(4))


def case_order(rank, world):
    a, b = dist.new_group([0, 1, 2, 3]), dist.new_group([0, 1, 2, 3])
    x = torch.ones(4)
    if rank == 3:
        dist.all_reduce(x, group=b)  # <order>
        dist.all_reduce(x, group=a)
    else:
        dist.all_reduce(x, group=a)
        dist.all_reduce(x, group=b)


def case_p2p(rank, world):
    x = torch.ones(4)
    if rank == 0:
        for peer in range(1, world):
            for _ in range(4):
                dist.send(x, peer)
    else:
        for _ in range(5 if rank == 1 else 4):  # <p2p>
            dist.recv(x, 0)
    dist.barrier()


def case_alltoall(rank, world):
    dist.all_reduce(torch.ones(4))
    splits = [1] * world
    if rank == 2:
        splits = [2, 0, 1, 1]
    out = torch.empty(world * 2, 3)
    dist.all_to_all_single(out[:world], torch.ones(sum(splits), 3), [1] * world,  # <alltoall>
                           splits)
    dist.all_reduce(torch.ones(4))


def case_condition(rank, world):
    loss = torch.tensor(2.0 + rank / 2)  # rank 3's "loss" is 3.5
    x = torch.ones(4)
    for step in range(3):
        dist.all_reduce(x)
        if loss > 3.2 and step == 1:
            dist.all_reduce(loss)  # <condition>
    dist.all_reduce(x)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x, skip=None):
        for i, layer in enumerate(self.layers):
            if i != skip:  # <fsdp>
                x = torch.relu(layer(x))
        return x


def case_ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(_Net(), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        out = model(torch.ones(4, 16), skip=1 if rank == 1 else None)
        out.sum().backward()  # <ddp>
        opt.step()
        opt.zero_grad()


def case_fsdp(rank, world):
    from torch.distributed.fsdp import fully_shard
    model = _Net()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    for _ in range(2):
        out = model(torch.ones(4, 16), skip=1 if rank == 1 else None)
        out.sum().backward()


def case_pipeline(rank, world):
    x = torch.ones(2, 4)
    microbatches = 3 if rank == 2 else 4
    for _ in range(microbatches):  # <pipeline>
        if rank > 0:
            dist.recv(x, rank - 1)
        if rank < world - 1:
            dist.send(x * 2, rank + 1)
    dist.barrier()


def _dump_later(directory: str, seconds: float) -> None:
    def dump():
        time.sleep(seconds)
        os.makedirs(directory, exist_ok=True)
        data = torch._C._distributed_c10d._dump_fr_trace()
        with open(os.path.join(directory, f"fr_{dist.get_rank()}"), "wb") as f:
            f.write(data if isinstance(data, bytes) else pickle.dumps(data))
        if os.environ.get("CASE_EXIT_AFTER_DUMP"):
            os._exit(0)
    threading.Thread(target=dump, daemon=True).start()


def main(argv: list[str]) -> None:
    case = argv[0]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if "--fr" in argv:
        _dump_later(argv[argv.index("--fr") + 1], float(os.environ.get("CASE_DUMP_AFTER", 4)))
    globals()[f"case_{case}"](rank, world)
    if "--fr" in argv:  # a healthy end: wait for the dump, as a hang would
        time.sleep(float(os.environ.get("CASE_DUMP_AFTER", 4)) + 6)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
