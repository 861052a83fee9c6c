"""Pipeline schedules on real gloo ranks equal one process (fp32, rtol 1e-5), and the ledger agrees.

One 4-rank world runs every case: pp = 4, or pp = 2 with dp = 2 (two independent pipelines, so
the per-(dp) pp groups are exercised too), or pp = 1 with dp = 4 for no pipelining. The model is
a stack of 8 residual MLP blocks ``x + fc2(gelu(fc1(x)))`` on ``[s, b, h]`` activations with a
mean-squared-error loss on the last stage.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraloom import comm
from paraloom import commands as cli
from paraloom.ledger import Ledger, merge, recording
from paraloom.mesh import ParallelMesh
from paraloom.pipeline_parallel import p2p, schedules
from paraloom.pipeline_parallel.stage import layer_range
from paraloom.pipeline_parallel.timetable import in_flight_profile

S, B, H, L = 4, 2, 8, 8
TOL = dict(rtol=1e-5, atol=1e-6)
FUNCS = {"none": schedules.forward_backward_no_pipelining,
         "1f1b": schedules.forward_backward_pipelining_without_interleaving,
         "interleaved": schedules.forward_backward_pipelining_with_interleaving,
         "gpipe": schedules.forward_backward_gpipe}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):  # [s, b, h]
        return x + self.fc2(F.gelu(self.fc1(x)))


class Chunk(nn.Module):
    """Some global layers of the stack; the schedule hands it its input via set_input_tensor."""

    def __init__(self, blocks: dict[int, Block]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): b for i, b in blocks.items()})
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, x):
        h = x if self.input_tensor is None else self.input_tensor  # [s, b, h]
        for block in self.layers.values():
            h = block(h)
        return h


def make_blocks() -> list[Block]:
    torch.manual_seed(0)
    return [Block() for _ in range(L)]


def make_data(m: int, seq: int = S) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(seq, B, H, generator=g), torch.randn(seq, B, H, generator=g))
            for _ in range(m)]


def mse(output, target):
    return F.mse_loss(output, target)


def forward_step(data_iterator, model):
    x, target = next(data_iterator)
    return model(x), functools.partial(mse, target=target)


def reference(m: int):
    """The single-process model: mean loss over microbatches, its gradients by global name."""
    model = Chunk(dict(enumerate(make_blocks())))
    losses = [mse(model(x), t) for x, t in make_data(m)]
    torch.stack(losses).mean().backward()
    return [x.detach() for x in losses], {n: p.grad for n, p in model.named_parameters()}


def run_case(schedule: str, pp: int, m: int, vpp: int = 1, forward_only: bool = False,
             variable_seq_lengths: bool = False, return_events: bool = False,
             overlap: bool | None = None):
    comm.set_timeout(30)  # a deadlock fails in 30 s instead of hanging the world
    mesh = ParallelMesh(pp=pp, dp=4 // pp, vpp=vpp if vpp > 1 else None)
    blocks = make_blocks()
    chunks = [Chunk({i: blocks[i] for i in layer_range(L, pp, mesh.pp.rank, vpp, c)})
              for c in range(vpp)]
    data = make_data(m)
    iters = [iter(data) for _ in chunks] if schedule == "interleaved" else iter(data)
    model = chunks if schedule == "interleaved" else chunks[0]
    stats, ledger = schedules.PipelineStats(), Ledger(rank=dist.get_rank())
    syncs = []
    with recording(ledger):
        losses = FUNCS[schedule](forward_step, iters, model, m, S, B, forward_only, mesh=mesh,
                                 hidden_size=H, stats=stats, no_sync_func=lambda: _Count(syncs),
                                 variable_seq_lengths=variable_seq_lengths,
                                 overlap_p2p_comm=overlap)
    ref_losses, ref_grads = reference(m)
    if mesh.is_last_stage:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), **TOL)
    else:
        assert losses == []
    checked = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if forward_only:
                assert param.grad is None, name
            else:
                torch.testing.assert_close(param.grad, ref_grads[name], **TOL,
                                           msg=lambda s, n=name: f"{n}: {s}")
            checked.append(name)
    events = ledger.events
    if return_events:
        return events
    spans = [(e["site"].split(".")[1][0].upper(), e["microbatch"], e["chunk"]) for e in events
             if e["op"] == "compute"]
    p2p_events = [{k: e[k] for k in ("op", "phase", "kind", "bytes", "microbatch", "site",
                                     "peer", "shape")} for e in events if e["kind"] == "pp"]
    asyncs = {e["async"] for e in events if e["kind"] == "pp"}
    return dict(stage=mesh.pp.rank, dp=mesh.dp.rank, checked=checked, p2p=p2p_events,
                asyncs=asyncs,
                spans=spans, max_in_flight=stats.max_in_flight, syncs=len(syncs),
                span_profile=max(in_flight_profile(spans), default=0))


class _Count:
    def __init__(self, calls):
        calls.append(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


CASES = [("none", 1, 4, 1), ("none", 1, 8, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
         ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2)]


@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward_only"])
@pytest.mark.parametrize("schedule,pp,m,vpp", CASES)
def test_equivalence_and_ledger(world4, schedule, pp, m, vpp, forward_only):
    results = world4.run(run_case, schedule, pp, m, vpp, forward_only)
    every = {n for r in results if r["dp"] == 0 for n in r["checked"]}
    assert len(every) == 4 * L  # every parameter of the stack was compared on some stage
    nbytes = S * B * H * 4
    for r in results:
        stage, acts, grads = r["stage"], [], []
        for e in r["p2p"]:
            assert e["kind"] == "pp" and e["bytes"] == nbytes and e["shape"] == [S, B, H]
            assert e["site"].startswith("p2p.")
            if e["op"] == "send":
                (acts if e["phase"] == "forward" else grads).append(e["microbatch"])
        # each boundary crossing carries m activations forward and m gradients back
        crossings = vpp - (1 if stage == pp - 1 else 0) if pp > 1 else 0
        assert sorted(acts) == sorted(list(range(m)) * crossings), (stage, acts)
        back = 0 if forward_only or pp == 1 else vpp - (1 if stage == 0 else 0)
        assert sorted(grads) == sorted(list(range(m)) * back), (stage, grads)
        f_spans = sorted((mb, c) for k, mb, c in r["spans"] if k == "F")
        assert f_spans == sorted((mb, c) for mb in range(m) for c in range(vpp))
        assert sum(k == "B" for k, _, _ in r["spans"]) == (0 if forward_only else m * vpp)
        if not forward_only and schedule == "1f1b":
            assert r["max_in_flight"] == r["span_profile"] == min(pp - stage, m)
        if not forward_only:  # gradient sync only in each chunk's last backward
            assert r["syncs"] == vpp * (m - 1)
        if schedule == "none" and not forward_only:
            assert r["max_in_flight"] == 1


def test_in_flight_1f1b_vs_gpipe(world4):
    """Stage 0 holds at most p microbatches under 1F1B, all m under all-forward-all-backward."""
    pp, m = 4, 8
    one = world4.run(run_case, "1f1b", pp, m)
    gpipe = world4.run(run_case, "gpipe", pp, m)
    first = [r for r in one if r["stage"] == 0][0]
    assert first["max_in_flight"] <= pp and first["span_profile"] <= pp
    assert all(r["max_in_flight"] == m for r in gpipe)


@pytest.mark.parametrize("schedule,pp,m,vpp", [("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2)])
def test_blocking_plan(world4, schedule, pp, m, vpp):
    """overlap_p2p_comm=False runs the blocking batches: same gradients, same messages."""
    blocking = world4.run(run_case, schedule, pp, m, vpp, False, False, False, False)
    overlapped = world4.run(run_case, schedule, pp, m, vpp)
    key = lambda e: (e["op"], e["phase"], e["microbatch"], e["peer"])  # noqa: E731
    for b, o in zip(blocking, overlapped, strict=True):
        # isend/irecv either way; the blocking plan batches a send with a receive
        assert b["asyncs"] == o["asyncs"] == {True}
        assert any("_recv_" in e["site"] for e in b["p2p"])
        # 1F1B: paraloom's plan posts every op alone; interleaved: Megatron-Core's overlapped
        # schedule, whose warm-up and cool-down calls pair a send with a receive
        assert any("_recv_" in e["site"] for e in o["p2p"]) == (schedule == "interleaved")
        assert sorted(map(key, b["p2p"])) == sorted(map(key, o["p2p"]))


def test_overlap_shows_in_ledger(world4):
    """Each receive but a stage's very first is posted before a compute step that ends before
    the receive is waited for (the transfer overlapped it); sends are waited for late too."""
    for events in world4.run(run_case, "1f1b", 4, 8, 1, False, False, True):
        spans = [e for e in events if e["op"] == "compute"]
        stage = spans[0]["stage"]
        pp = [e for e in events if e["kind"] == "pp"]
        assert all(e["async"] and e["t_start"] <= e["t_wait"] <= e["t_end"] for e in pp)

        def overlapped(e, spans=spans):
            return any(e["t_start"] <= s["t_start"] and s["t_end"] <= e["t_wait"] for s in spans)

        recvs = [e for e in pp if e["op"] == "recv"]
        assert len(recvs) == (8 if stage else 0) + (8 if stage < 3 else 0)
        assert sum(map(overlapped, recvs)) == len(recvs) - (1 if stage else 0)
        sends = [e for e in pp if e["op"] == "send"]
        assert sum(map(overlapped, sends)) >= len(sends) - 2


def test_variable_seq_lengths(world4):
    """With the shape exchange the result is unchanged; each message is preceded by its shape."""
    results = world4.run(run_case, "1f1b", 2, 4, 1, False, True)
    for r in results:
        shapes = [e for e in r["p2p"] if e["site"].endswith(".shape") and e["op"] == "send"]
        data = [e for e in r["p2p"] if not e["site"].endswith(".shape") and e["op"] == "send"]
        assert len(shapes) == len(data) == 4 and all(e["bytes"] == 64 for e in shapes)


def shape_case(bad_shapes):
    comm.set_timeout(30)
    mesh = ParallelMesh(pp=4)
    errors = []
    if mesh.pp.rank == 0:
        for raw in bad_shapes:
            comm.batch_p2p([("send", torch.tensor(raw, dtype=torch.int64), mesh.next_rank)],
                           mesh.pp, phase="forward", kind="pp", site="test.bad_shape")
        p2p.communicate([("send", "next", torch.ones(6, B, H), "forward", None)], mesh=mesh,
                        tensor_shape=(6, B, H), variable_seq_lengths=True)
    elif mesh.pp.rank == 1:
        recv = [("recv", "prev", None, "forward", None)]
        for _ in bad_shapes:
            with pytest.raises(ValueError) as info:
                p2p.communicate(recv, mesh=mesh, tensor_shape=(S, B, H), variable_seq_lengths=True)
            errors.append(str(info.value))
        got, = p2p.communicate(recv, mesh=mesh, tensor_shape=(S, B, H), variable_seq_lengths=True)
        assert got.shape == (6, B, H) and got.requires_grad and bool((got == 1).all())
    return errors


def test_shape_exchange_errors(world4):
    pad = [0] * 4
    bad = [[2, S, B] + [0] * 5,                      # 2 dims where [s, b, h] is expected
           [3, S, -1, H] + pad,                      # a negative size
           [3, 2 ** 20, 2 ** 20, 4] + pad,            # 2**42 elements: refused, not allocated
           [100, 1, 1, 1] + pad]                     # an absurd number of dims
    errors = world4.run(shape_case, bad)[1]
    assert len(errors) == 4 and all("from rank 0" in e for e in errors)
    assert "2 dims" in errors[0] and "-1" in errors[1] and "limit" in errors[2]
    assert "100 dims" in errors[3]


def test_schedule_picture_from_recorded_run(world4, tmp_path, capsys):
    """``paraloom schedule RUN_DIR`` draws a real interleaved run from its ledger.jsonl."""
    per_rank = world4.run(run_case, "interleaved", 4, 8, 2, False, False, True)
    with open(tmp_path / "ledger.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in merge(per_rank))
    assert cli.main(["schedule", str(tmp_path), "--out", str(tmp_path / "run.png")]) == 0
    bubble = float(capsys.readouterr().out.split("bubble fraction: ")[1].split()[0])
    assert 0.0 < bubble < 1.0
    assert (tmp_path / "run.png").stat().st_size > 1000
