"""``paraloom plan --search``: every valid layout of a job that fits memory, ranked by predicted
throughput, with the reason each one wins or loses.

A layout is (tp, cp, ep, pp, dp, vpp, micro batch, sequence parallel, recomputation,
distributed optimizer) for a fixed model, sequence length, global batch and GPU count; valid when
the divisions Megatron needs hold (heads and hidden by tp, layers by pp * vpp, the global batch
by micro batch * dp, microbatches by pp for the interleaved schedule, the sequence by tp under
sequence parallelism and by 2 cp under cp, the experts and dp by ep). cp takes the powers of two
up to ``--max-cp``; ep is tried only for a MoE model (``--num-experts``). Memory is
:func:`paraloom.analysis.plan.memory_per_gpu` (the busiest stage) plus :func:`transient_bytes`
(the layer being recomputed: a long sequence's attention scores), against ``fit_fraction`` of the
GPU's memory (the rest: CUDA context, allocator slack, logits). Time is
:func:`paraloom.analysis.steptime.step_time`, a few ten microseconds a layout, so a 1024-GPU
search (about 25 000 candidates with cp) takes seconds.

    paraloom plan --search --gpus 1024 --layers 96 --hidden 12288 --heads 96 --seq-len 2048 \\
        --global-batch-size 1536 --gpu a100-80gb
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

from .arch import Architecture
from .formulas import CommConfig, activation_bytes_per_layer
from .hardware import Hardware, add_hardware_args, hardware_from_args
from .moe_formulas import MoECommConfig
from .plan import GPT2_VOCAB, human_bytes, memory_per_gpu, padded_vocab
from .steptime import Options, spans_nodes, step_time

__all__ = ["Candidate", "cp_sizes", "transient_bytes", "layouts", "search", "explain",
           "search_main"]


@dataclass(frozen=True)
class Candidate:
    """One layout that fits, with its prediction."""

    tp: int
    pp: int
    dp: int
    vpp: int
    micro_batch: int
    sequence_parallel: bool
    recompute: str
    distributed_optimizer: bool
    cp: int
    step_time_s: float
    memory_bytes: float
    prediction: dict
    ep: int = 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_sizes(gpus: int, seq_len: int, max_cp: int = 32) -> tuple[int, ...]:
    """The cp sizes worth trying: powers of two up to ``max_cp`` that divide ``gpus`` and cut
    the sequence into ``2 cp`` equal chunks (load-balanced causal attention)."""
    return tuple(cp for cp in (2 ** i for i in range(max_cp.bit_length()))
                 if cp <= max_cp and gpus % cp == 0 and seq_len % (2 * cp) == 0 or cp == 1)


def transient_bytes(c: CommConfig) -> float:
    """Bytes one layer needs on top of what ``memory_per_gpu`` keeps for backward: under full
    recomputation the re-run layer's whole activations, under selective the re-run attention
    scores (written-out attention), each for ``s/cp`` tokens (the cp ring computes ``s/cp``
    queries against ``s/cp`` keys at a time). This is what makes a long sequence need cp."""
    if c.recompute == "none":
        return 0.0
    s = c.seq_len // c.cp
    kw = dict(sequence_parallel=c.sp, attention=c.arch.attention)
    full = activation_bytes_per_layer(s, c.micro_batch, c.hidden, c.heads, c.tp, **kw)
    kept = activation_bytes_per_layer(s, c.micro_batch, c.hidden, c.heads, c.tp,
                                      recompute=c.recompute, **kw)
    return (full - kept) * c.dtype_bytes / 2


def layouts(gpus: int, *, layers: int, hidden: int, heads: int, seq_len: int,
            global_batch: int, cps=(1,), max_vpp: int = 4, micro_batches=(1, 2, 4, 8, 16)):
    """Every valid ``(tp, cp, pp, dp, vpp, b, sp, recompute, zero)`` for the job."""
    for cp in cps:
        if gpus % cp or (cp > 1 and seq_len % (2 * cp)):
            continue
        for tp in _divisors(gpus // cp):
            if heads % tp or hidden % tp:
                continue
            for pp in _divisors(gpus // (cp * tp)):
                if layers % pp:
                    continue
                dp = gpus // (cp * tp * pp)
                for b in micro_batches:
                    if global_batch % (b * dp):
                        continue
                    m = global_batch // (b * dp)
                    vpps = [v for v in range(1, max_vpp + 1) if layers % (pp * v) == 0
                            and (v == 1 or (pp > 1 and m % pp == 0))]
                    for v in vpps:
                        for sp in ([False, True] if tp > 1 and seq_len % tp == 0 else [False]):
                            for rc in ("none", "selective", "full"):
                                for zero in ([False, True] if dp > 1 else [False]):
                                    yield tp, cp, pp, dp, v, b, sp, rc, zero


def no_valid_layout(gpus: int, *, layers: int, hidden: int, heads: int, seq_len: int,
                    global_batch: int) -> str:
    """Why no ``tp * cp * pp * dp = gpus`` splits the job, and the nearest GPU counts that do."""
    def valid(n: int) -> bool:
        return any(True for _ in layouts(n, layers=layers, hidden=hidden, heads=heads,
                                         seq_len=seq_len, global_batch=global_batch,
                                         cps=cp_sizes(n, seq_len)))
    near = [n for n in sorted(range(1, 2 * gpus + 1), key=lambda n: (abs(n - gpus), n))
            if n != gpus and valid(n)][:3]
    return (f"no layout of {gpus} GPUs splits this job (memory is not the problem): tp must "
            f"divide --heads {heads} and --hidden {hidden}, pp must divide --layers {layers}, "
            f"micro-batch x dp must divide --global-batch-size {global_batch}, and cp must cut "
            f"--seq-len {seq_len} into 2 cp equal chunks"
            + (f"; GPU counts that do: {', '.join(map(str, sorted(near)))}" if near else ""))


def search(gpus: int, hw: Hardware, *, layers: int, hidden: int, heads: int, seq_len: int,
           global_batch: int, vocab: int = GPT2_VOCAB, ffn: int | None = None,
           dtype_bytes: int = 2, fit_fraction: float = 0.9, cps=None, cp_comm_type="p2p",
           num_experts: int | None = None, moe_topk: int = 2, moe_layer_freq: int = 1,
           arch: Architecture | None = None,
           options: Options | None = None) -> tuple[list[Candidate], int]:
    """All fitting layouts, fastest first, and how many valid ones did not fit. ``cps``:
    the cp sizes to try (default :func:`cp_sizes`); with ``num_experts`` every ep that divides
    both dp and the experts is tried too."""
    o, arch = options or Options(), arch or Architecture()
    fits, too_big = [], 0
    for tp, cp, pp, dp, v, b, sp, rc, zero in layouts(
            gpus, layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
            global_batch=global_batch, cps=cp_sizes(gpus, seq_len) if cps is None else cps):
        if arch.num_query_groups and arch.num_query_groups % tp:  # GQA: groups split over tp
            continue
        eps = [e for e in _divisors(dp) if num_experts % e == 0] if num_experts else [1]
        for ep in eps:
            moe = MoECommConfig(num_experts=num_experts, topk=moe_topk, ep=ep,
                                layer_freq=moe_layer_freq) if num_experts else None
            c = CommConfig(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
                           vocab=padded_vocab(vocab, 128, tp), ffn=ffn, micro_batch=b,
                           num_microbatches=global_batch // (b * dp), tp=tp, pp=pp, dp=dp,
                           vpp=v if v > 1 else None, sequence_parallel=sp, recompute=rc,
                           distributed_optimizer=zero, dtype_bytes=dtype_bytes, buckets=(1,),
                           cp=cp, cp_comm_type=cp_comm_type, moe=moe, arch=arch)
            mem = memory_per_gpu(c)["total"] + transient_bytes(c)
            if mem > fit_fraction * hw.hbm_bytes:
                too_big += 1
                continue
            r = step_time(c, hw, o)
            fits.append(Candidate(tp, pp, dp, v, b, sp, rc, zero, cp, r["step_time_s"], mem, r,
                                  ep))
    fits.sort(key=lambda x: (x.step_time_s, x.memory_bytes))
    return fits, too_big


_PART = {"recompute": "recomputation", "tp_comm": "exposed tp/sp communication",
         "cp_comm": "exposed cp K/V exchange",
         "ep_comm": "expert all-to-all",
         "pp_comm": "pipeline p2p", "bubble": "pipeline bubble", "dp_comm": "exposed dp "
         "reduction", "emb_comm": "embedding reduction", "optimizer": "optimizer step",
         "compute": "compute"}


def explain(x: Candidate, best: Candidate, hw: Hardware) -> str:
    """Why ``x`` wins, or what it loses to ``best``, part by part."""
    parts = x.prediction["breakdown_s"]
    notes = []
    if spans_nodes(1, x.tp, hw.gpus_per_node):
        notes.append(f"tp={x.tp} spans nodes: InfiniBand")
    if spans_nodes(x.tp, x.cp, hw.gpus_per_node):
        notes.append(f"cp={x.cp} spans nodes")
    if spans_nodes(x.tp * x.cp, x.ep, hw.gpus_per_node):
        notes.append(f"ep={x.ep} spans nodes")
    if x is best:
        lost = sorted(((v, k) for k, v in parts.items() if k != "compute"), reverse=True)
        share = parts["compute"] / x.step_time_s
        main = ", ".join(f"{_PART[k]} {v / x.step_time_s:.0%}" for v, k in lost[:2] if v > 0)
        return f"fastest: compute is {share:.0%} of the step" + (f"; left: {main}" if main else "")
    base = best.prediction["breakdown_s"]
    diff = sorted(((parts[k] - base[k], k) for k in parts), reverse=True)
    slower = x.step_time_s / best.step_time_s - 1
    why = ", ".join(f"+{d / best.step_time_s:.0%} {_PART[k]}" for d, k in diff[:2] if d > 0)
    return f"{slower:+.1%} vs best: {why}" + (f" ({'; '.join(notes)})" if notes else "")


def _row(i: int, x: Candidate, best: Candidate, hw: Hardware) -> str:
    r = x.prediction
    return (f"{i:>3} {x.tp:>3} {x.cp:>3} {x.ep:>3} {x.pp:>3} {x.dp:>5} {x.vpp:>3} "
            f"{x.micro_batch:>3} "
            f"{'on' if x.sequence_parallel else 'off':>3} {x.recompute:>9} "
            f"{'on' if x.distributed_optimizer else 'off':>4} {x.step_time_s:>9.3f} "
            f"{r['mfu']:>5.1%} {human_bytes(x.memory_bytes):>10}  {explain(x, best, hw)}")


def search_main(argv: list[str] | None = None) -> int:
    """``paraloom plan --search --gpus N ...``: the ranked table (``--json`` for machines)."""
    ap = argparse.ArgumentParser(prog="paraloom plan --search",
                                 description="rank the layouts of a job that fit memory")
    ap.add_argument("--search", action="store_true")
    ap.add_argument("--gpus", type=int, required=True)
    for name in ("layers", "hidden", "heads", "seq-len", "global-batch-size"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=GPT2_VOCAB)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    ap.add_argument("--max-cp", type=int, default=32,
                    help="largest context-parallel size tried (powers of two; default 32)")
    ap.add_argument("--cp-comm-type", choices=("p2p", "all_gather"), default="p2p")
    ap.add_argument("--num-experts", type=int, default=None,
                    help="MoE: experts per MoE layer (then every ep dividing dp is tried)")
    ap.add_argument("--moe-router-topk", type=int, default=2)
    ap.add_argument("--moe-layer-freq", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    add_hardware_args(ap)
    from ..commands.arch_flags import add_architecture_flags, architecture_from_args
    add_architecture_flags(ap)
    a = ap.parse_args(argv)
    try:
        hw = hardware_from_args(a)
        for name in ("gpus", "layers", "hidden", "heads", "seq_len", "global_batch_size",
                     "vocab", "top", "max_cp", "moe_router_topk", "moe_layer_freq"):
            if getattr(a, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(a, name)}")
        if a.hidden % a.heads:
            raise ValueError(f"--hidden {a.hidden} is not divisible by --heads {a.heads}")
        arch = Architecture(**{k: v for k, v in architecture_from_args(a).items()
                               if k in Architecture.__dataclass_fields__})
        if arch.num_query_groups and a.heads % arch.num_query_groups:
            raise ValueError(f"--num-query-groups {arch.num_query_groups} must divide --heads "
                             f"{a.heads}")
        if a.num_experts is not None and not arch.is_gpt2:
            raise ValueError("--num-experts: experts are GeLU MLPs with biases for now; "
                             "use the GPT-2 MLP flags with MoE")
        if a.num_experts is not None and a.num_experts < 1:
            raise ValueError(f"--num-experts must be >= 1, got {a.num_experts}")
        if a.num_experts is not None and not a.moe_router_topk <= a.num_experts:
            raise ValueError(f"--num-experts must be >= --moe-router-topk "
                             f"({a.moe_router_topk}), got {a.num_experts}")
    except ValueError as err:
        print(f"paraloom plan: error: {err}", file=sys.stderr)
        return 2
    tic = time.perf_counter()
    fits, too_big = search(a.gpus, hw, layers=a.layers, hidden=a.hidden, heads=a.heads,
                           seq_len=a.seq_len, global_batch=a.global_batch_size, vocab=a.vocab,
                           ffn=a.ffn or (int(4 * a.hidden * 2 / 3 / 64) * 64 if arch.swiglu
                                         else None),
                           dtype_bytes=2 if a.dtype == "bf16" else 4, arch=arch,
                           cps=cp_sizes(a.gpus, a.seq_len, a.max_cp),
                           cp_comm_type=a.cp_comm_type, num_experts=a.num_experts,
                           moe_topk=a.moe_router_topk, moe_layer_freq=a.moe_layer_freq)
    took = time.perf_counter() - tic
    if a.json:
        print(json.dumps({"hardware": hw.to_dict(), "layouts_fitting": len(fits),
                          "layouts_too_big": too_big, "seconds": took,
                          "ranked": [asdict(x) for x in fits[:a.top]]}, indent=2))
        return 0
    print(f"{len(fits)} layouts fit {human_bytes(0.9 * hw.hbm_bytes)} of {hw.name} "
          f"({too_big} valid ones do not); searched in {took:.2f} s")
    if not fits and too_big:
        print("nothing fits: more GPUs, a shorter sequence or a smaller model")
        return 1
    if not fits:
        print(no_valid_layout(a.gpus, layers=a.layers, hidden=a.hidden, heads=a.heads,
                              seq_len=a.seq_len, global_batch=a.global_batch_size))
        return 1
    print("  # " + " ".join(f"{h:>{w}}" for h, w in (
        ("tp", 3), ("cp", 3), ("ep", 3), ("pp", 3), ("dp", 5), ("vpp", 3), ("mb", 3), ("sp", 3),
        ("recompute", 9), ("zero", 4), ("step s", 9), ("MFU", 5), ("memory", 10))) + "  why")
    for i, x in enumerate(fits[:a.top], 1):
        print(_row(i, x, fits[0], hw))
    return 0
