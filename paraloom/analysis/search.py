"""Every valid layout of a job that fits memory, ranked by predicted throughput, with the reason
each one wins or loses (``paraloom plan --search``).

A layout is (tp, cp, ep, pp, dp, vpp, micro batch, sequence parallel, recomputation,
distributed optimizer) for a fixed model, sequence length, global batch and GPU count; valid when
the divisions Megatron needs hold (heads and hidden by tp, layers by pp * vpp, the global batch
by micro batch * dp, microbatches by pp for the interleaved schedule, the sequence by tp under
sequence parallelism and by 2 cp under cp, the experts and dp by ep). cp takes the powers of two
up to ``--max-cp``, each with the ring, the all-gather, Ulysses' all-to-all (where cp divides
a tp rank's heads) and hierarchical a2a+p2p (at :func:`hierarchical_inner`'s level) unless
``--cp-comm-type`` names one; ep is tried only for a MoE model
(``--num-experts``). Memory is
:func:`paraloom.analysis.memory_formulas.memory_per_gpu` (the busiest stage) plus
:func:`transient_bytes` (the layer being recomputed: a long sequence's attention scores),
against ``fit_fraction`` of the GPU's memory (the rest: CUDA context, allocator slack,
logits). Time is :func:`paraloom.analysis.steptime.step_time`, a few ten microseconds a layout,
so a 1024-GPU search (about 25 000 candidates with cp) takes seconds.

    paraloom plan --search --gpus 1024 --layers 96 --hidden 12288 --heads 96 --seq-len 2048 \\
        --global-batch-size 1536 --gpu a100-80gb
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.model import padded_vocab_rows
from ..utils import divisors
from .costs import Options, spans_nodes
from .hardware import Hardware
from .plan import GPT2_VOCAB
from .search_variants import (
    FIT_FRACTION,
    memory_fit,
    transient_bytes,
    with_instances,
    with_megatron_fsdp,
)
from .spec import Architecture, CommConfig, MoECommConfig
from .steptime import step_time

__all__ = ["Candidate", "cp_sizes", "transient_bytes", "memory_fit", "layouts", "search",
           "explain", "no_valid_layout", "FIT_FRACTION"]



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
    cp_comm_type: str = "p2p"
    dispatcher: str = ""
    """The MoE token dispatcher (``allgather`` or ``alltoall``; empty for a dense model)."""
    instances: int = 1
    """``--num-distributed-optimizer-instances`` (the distributed optimizer's copies)."""
    cp_a2a: int = 1
    """``a2a+p2p``: the all-to-all level ``A`` (``--hierarchical-context-parallel-sizes A
    cp/A``)."""
    fsdp: str = ""
    """Megatron-FSDP's sharding strategy (empty: Megatron's DDP)."""


def cp_sizes(gpus: int, seq_len: int, max_cp: int = 32) -> tuple[int, ...]:
    """The cp sizes worth trying: powers of two up to ``max_cp`` that divide ``gpus`` and cut
    the sequence into ``2 cp`` equal chunks (load-balanced causal attention)."""
    return tuple(cp for cp in (2 ** i for i in range(max_cp.bit_length()))
                 if cp <= max_cp and gpus % cp == 0 and seq_len % (2 * cp) == 0 or cp == 1)


def hierarchical_inner(cp: int, tp: int, heads: int, groups: int, gpus_per_node: int
                       ) -> int | None:
    """``A`` for ``a2a+p2p`` at this cp: the largest level that divides cp, leaves at least two
    groups for the ring, divides a tp rank's query and key/value heads and keeps its tp x A
    ranks in one node (the all-to-all on the fast links); ``None`` if there is none."""
    fits = [a for a in range(2, cp // 2 + 1) if cp % a == 0 and (heads // tp) % a == 0
            and (groups // tp) % a == 0 and tp * a <= gpus_per_node]
    return max(fits, default=None)


def layouts(gpus: int, *, layers: int, hidden: int, heads: int, seq_len: int,
            global_batch: int, cps=(1,), max_vpp: int = 4, micro_batches=(1, 2, 4, 8, 16)):
    """Every valid ``(tp, cp, pp, dp, vpp, b, sp, recompute, zero)`` for the job."""
    for cp in cps:
        if gpus % cp or (cp > 1 and seq_len % (2 * cp)):
            continue
        for tp in divisors(gpus // cp):
            if heads % tp or hidden % tp:
                continue
            for pp in divisors(gpus // (cp * tp)):
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
                    global_batch: int, query_groups: int | None = None) -> str:
    """Why no ``tp * cp * pp * dp = gpus`` splits the job, and the nearest GPU counts that do.
    ``query_groups``: grouped-query attention's key/value heads, which tp must divide too."""
    def valid(n: int) -> bool:
        return any(not query_groups or query_groups % split[0] == 0
                   for split in layouts(n, layers=layers, hidden=hidden, heads=heads,
                                        seq_len=seq_len, global_batch=global_batch,
                                        cps=cp_sizes(n, seq_len)))
    near = [n for n in sorted(range(1, 2 * gpus + 1), key=lambda n: (abs(n - gpus), n))
            if n != gpus and valid(n)][:3]
    groups = f", --num-query-groups {query_groups}" if query_groups else ""
    return (f"no layout of {gpus} GPUs splits this job (memory is not the problem): tp must "
            f"divide --heads {heads}{groups} and --hidden {hidden}, pp must divide --layers "
            f"{layers}, micro-batch x dp must divide --global-batch-size {global_batch}, and cp "
            f"must cut --seq-len {seq_len} into 2 cp equal chunks"
            + (f"; GPU counts that do: {', '.join(map(str, sorted(near)))}" if near else ""))


def search(gpus: int, hw: Hardware, *, layers: int, hidden: int, heads: int, seq_len: int,
           global_batch: int, vocab: int = GPT2_VOCAB, vocab_multiple: int = 128,
           ffn: int | None = None,
           dtype_bytes: int = 2, fit_fraction: float = FIT_FRACTION, cps=None,
           cp_comm_types: tuple[str, ...] = ("p2p",),
           num_experts: int | None = None, moe_topk: int = 2, moe_layer_freq: int = 1,
           moe_shared_ffn: int = 0, moe_shared_gate: bool = False,
           dispatchers: tuple[str, ...] = ("allgather",),
           arch: Architecture | None = None,
           options: Options | None = None) -> tuple[list[Candidate], int]:
    """All fitting layouts, fastest first, and how many valid ones did not fit. ``cps``:
    the cp sizes to try (default :func:`cp_sizes`), each with every comm type of
    ``cp_comm_types`` that applies (``a2a``: cp divides the heads and key/value heads of a tp
    rank; ``a2a+p2p``: at the level :func:`hierarchical_inner` picks); with ``num_experts``
    every ep that divides both dp and the experts is tried too, with each token dispatcher of
    ``dispatchers``; the fastest distributed-optimizer layouts with several optimizer instances
    too (:mod:`.search_variants`)."""
    o, arch = options or Options(), arch or Architecture()
    fits, too_big, zeros = [], 0, []
    for tp, cp, pp, dp, v, b, sp, rc, zero in layouts(
            gpus, layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
            global_batch=global_batch, cps=cp_sizes(gpus, seq_len) if cps is None else cps):
        if arch.num_query_groups and arch.num_query_groups % tp:  # GQA: groups split over tp
            continue
        eps = [e for e in divisors(dp) if num_experts % e == 0] if num_experts else [1]
        inner = hierarchical_inner(cp, tp, heads, arch.num_query_groups or heads,
                                   hw.gpus_per_node) if cp > 1 else None
        kinds = [k for k in cp_comm_types if (k != "a2a" or (
            heads // tp % cp == 0 and (arch.num_query_groups or heads) // tp % cp == 0))
            and (k != "a2a+p2p" or inner)] if cp > 1 else [cp_comm_types[0]]
        # where nothing is dispatched (ep 1, every tp rank routing all tokens) one suffices
        ways = {e: ("",) if not num_experts else dispatchers if e > 1 or (tp > 1 and sp)
                else dispatchers[:1] for e in eps}
        for ep, cp_comm_type, way in ((e, k, d) for e in eps for k in kinds for d in ways[e]):
            moe = MoECommConfig(num_experts=num_experts, topk=moe_topk, ep=ep,
                                layer_freq=moe_layer_freq, shared_ffn=moe_shared_ffn,
                                shared_gate=moe_shared_gate, dispatcher=way) \
                if num_experts else None
            c = CommConfig(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
                           vocab=padded_vocab_rows(vocab, vocab_multiple, tp), ffn=ffn,
                           micro_batch=b,
                           num_microbatches=global_batch // (b * dp), tp=tp, pp=pp, dp=dp,
                           vpp=v if v > 1 else None, sequence_parallel=sp, recompute=rc,
                           distributed_optimizer=zero, dtype_bytes=dtype_bytes, buckets=(1,),
                           cp=cp, cp_comm_type=cp_comm_type, moe=moe, arch=arch,
                           cp_a2a=inner if cp_comm_type == "a2a+p2p" else 1)
            mem = memory_fit(c, hw, fit_fraction)["need_bytes"]
            if mem > fit_fraction * hw.hbm_bytes:
                too_big += 1
                continue
            r = step_time(c, hw, o)
            fits.append(Candidate(tp, pp, dp, v, b, sp, rc, zero, cp, r["step_time_s"], mem, r,
                                  ep, cp_comm_type, way, cp_a2a=c.cp_a2a))
            if zero:
                zeros.append((fits[-1], c))
    too_big += with_instances(fits, zeros, hw, o, fit_fraction)
    too_big += with_megatron_fsdp(fits, zeros, hw, o, fit_fraction)
    fits.sort(key=lambda x: (x.step_time_s, x.memory_bytes))
    return fits, too_big


_PART = {"recompute": "recomputation", "tp_comm": "exposed tp/sp communication",
         "cp_comm": "exposed cp K/V exchange",
         "ep_comm": "expert dispatch",
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
