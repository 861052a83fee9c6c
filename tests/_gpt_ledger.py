"""Shared by test_formulas and test_report: a GPT forward + backward recorded in a ledger."""

from __future__ import annotations

S, B, H, A, L, V = 16, 2, 32, 4, 2, 64


def record_gpt(tp: int, sp: bool, recompute: str, async_ar: bool = False) -> list[dict]:
    """One forward + backward of the GPT on this rank under a ledger (mesh tp=t, dp=4/t)."""
    import torch

    from paraloom.config import ModelConfig
    from paraloom.ledger import Ledger, recording
    from paraloom.mesh import ParallelMesh
    from paraloom.models.gpt import GPTModel, ParallelOptions

    cfg = ModelConfig(vocab_size=V, hidden_size=H, num_layers=L, num_attention_heads=A,
                      seq_length=S)
    mesh = ParallelMesh(tp=tp, dp=4 // tp)
    opt = ParallelOptions(sequence_parallel=sp, recompute=recompute, async_grad_allreduce=async_ar)
    model = GPTModel(cfg, mesh, options=opt)
    tokens = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(0))
    ledger = Ledger(mesh.rank)
    with recording(ledger):
        model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return ledger.events
