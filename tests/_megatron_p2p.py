"""Megatron-Core's pipeline point-to-point calls on 2 gloo ranks: a test-side program, never
shipped.

``paraloom record --nproc 2 --out DIR -- tests/_megatron_p2p.py`` builds megatron-core 0.19.2's
``P2PCommunicator`` over the world (rank 0 the first stage, rank 1 the last) and runs, with
``batch_p2p_comm`` off and then on (``use_ring_exchange_p2p`` and ``variable_seq_lengths`` at
Megatron's default, False), the calls of 1F1B's steady state in matching pairs:

1. rank 0 ``send_forward``            rank 1 ``recv_forward``
2. rank 0 ``recv_backward``           rank 1 ``send_backward``
3. rank 0 ``send_forward_recv_backward``   rank 1 ``send_backward_recv_forward``

each followed by a ``barrier`` (the recorded sequence is cut there, so each call's events are
known) and checks the values received. CUDA calls are the test shim's CPU stand-ins.
"""

from __future__ import annotations

import sys

SHAPE = (4, 2, 8)
CALLS = {0: ("send_forward", "recv_backward", "send_forward_recv_backward"),
         1: ("recv_forward", "send_backward", "send_backward_recv_forward")}
"""The P2PCommunicator methods each rank calls, in order (one per barrier)."""


def _exchange(comm, rank: int):
    import torch

    act, grad = torch.full(SHAPE, 1.0), torch.full(SHAPE, 2.0)
    if rank == 0:
        yield comm.send_forward(act, is_last_stage=False), None
        yield comm.recv_backward(SHAPE, is_last_stage=False), grad
        yield comm.send_forward_recv_backward(act, SHAPE, is_last_stage=False), grad
    else:
        yield comm.recv_forward(SHAPE, is_first_stage=False), act
        yield comm.send_backward(grad, is_first_stage=False), None
        yield comm.send_backward_recv_forward(grad, SHAPE, is_first_stage=False), act


def main() -> None:
    import torch
    import torch.distributed as dist
    from _megatron_shim import install

    dist.init_process_group("gloo")
    install()
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    rank = dist.get_rank()
    for batched in (False, True):
        config = ModelParallelConfig(pipeline_model_parallel_size=2, batch_p2p_comm=batched,
                                     pipeline_dtype=torch.float32)
        comm = P2PCommunicator(pp_group=dist.group.WORLD, config=config)
        for got, want in _exchange(comm, rank):
            if want is not None:
                torch.testing.assert_close(got.detach(), want)
            dist.barrier()
    print(f"rank {rank}: megatron-core p2p ok (batch_p2p_comm off, on)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main() if not sys.argv[1:] else sys.exit(f"usage: {sys.argv[0]} (no arguments)")
