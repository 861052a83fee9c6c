"""One rank's communication in a run's first step, in order, from the layout alone (``paraloom
plan --table``): the events ``paraloom table RUN --step 1 --rank R`` would show, at any size.

The order is the runtime's, derived from the same pure parts it executes:

* the pipeline's p2p plan (:func:`paraloom.pipeline_parallel.plans.p2p_plan`: blocking batches,
  or the overlapped plan the gloo backend runs), one event per send and receive; between them
  the forward (F) and backward (B) steps of each microbatch and model chunk;
* inside F: Megatron-LM's batch broadcast over tp on a chunk that reads data, the embedding's
  all-reduce, each layer's two tensor-parallel regions (all-reduce after the row-parallel
  layers; with sequence parallelism the all-gather before the column-parallel ones and the
  reduce-scatter after the row-parallel ones) with context parallelism's K/V exchange between
  them (the ring's p2p or one all-gather), the output layer and the vocabulary-parallel loss;
  inside B the same regions in reverse with their backward communication, each layer re-run
  first under full recomputation;
* after the schedule, the first step's data-parallel buckets (Megatron launches none from the
  gradient hooks in the first iteration), the sequence-parallel and tied-embedding gradient
  sums, and the optimizer step's agreements as :mod:`paraloom.training.train` issues them.

Groups of one rank record nothing, so they have no rows. A MoE layer's MLP region is
:mod:`.order_moe`'s, Megatron-FSDP's rows :mod:`.order_fsdp`'s; what it does not derive is
refused (:func:`check_supported`), not guessed.
"""

from __future__ import annotations

from ..config.train import TrainConfig
from ..pipeline_parallel.plans import batch_site, p2p_plan
from ..pipeline_parallel.stage import layer_range
from .layout import chunk_groups, sp_elems
from .order_cp import cp_rows
from .order_dp import bucket_rows, gather_site, grad_norm_rows, num_tokens_rows
from .order_fsdp import FsdpRows
from .order_loop import after_step_rows, batch_rows, train_step_rows
from .order_moe import moe_backward, moe_forward, moe_unsupported
from .spec import CommConfig

__all__ = ["check_supported", "step_one_events"]

_COL, _ROW = "ColumnParallelLinear weight, output dim", "RowParallelLinear weight, input dim"
_CE = "logits, vocabulary range"


def check_supported(cfg: TrainConfig) -> None:
    """``ValueError`` for what this reading does not derive yet."""
    why = moe_unsupported(cfg) if cfg.model.num_experts is not None else None
    if cfg.use_megatron_fsdp and cfg.bucket_size is not None:
        why = "Megatron-FSDP's buckets under --bucket-size (each launched as it completes)"
    if why:
        raise ValueError(f"plan --table does not derive the order of {why} yet; run the layout "
                         f"small and read `paraloom table RUN --step 1`")


def _event(out: list, **fields) -> None:
    shape = fields.get("shape")
    numel = 1
    for n in shape or ():
        numel *= n
    fields.setdefault("bytes", numel * fields.pop("itemsize", 4) if shape else 0)
    out.append({"seq": len(out), "t_start": float(len(out)), "t_end": float(len(out)),
                "step": 1, "split": None, "module": None, "async": False, **fields})


class _Rank:
    """The rank's place in the mesh (tp fastest, then cp, dp, pp) and its tensor shapes."""

    def __init__(self, cfg: TrainConfig, c: CommConfig, rank: int) -> None:
        p, m = cfg.parallel, cfg.model
        self.cfg, self.c, self.rank = cfg, c, rank
        self.tp, self.pp, self.v = p.tp, p.pp, p.vpp or 1
        self.pp_rank = rank // (p.tp * p.cp * p.dp)
        self.sp = p.uses_sequence_parallel
        self.item = 2 if cfg.dtype == "bf16" else 4
        s, b, h = m.seq_length, cfg.micro_batch_size, m.hidden_size
        local = s // p.cp  # each cp rank holds 2 of the 2 * cp chunks of a sequence
        self.full, self.part = [local, b, h], [local // p.tp if self.sp else local, b, h]
        self.b, self.s, self.local, self.cp = b, s, local, p.cp
        self.kv = [2, b, m.query_groups // p.tp, local, m.head_dim]  # K and V of this rank
        self.heads = (m.num_attention_heads // p.tp, m.query_groups // p.tp)  # a rank's q, k/v
        self.fsdp = FsdpRows(cfg, c, p.cp, self.item) if cfg.use_megatron_fsdp else None

    def moe(self, i: int) -> bool:
        m = self.cfg.model
        return m.num_experts is not None and i % m.moe_layer_freq == 0

    def chunk(self, c: int) -> tuple[bool, bool, range]:
        return (self.pp_rank == 0 and c == 0, self.pp_rank == self.pp - 1 and c == self.v - 1,
                layer_range(self.cfg.model.num_layers, self.pp, self.pp_rank, self.v, c))


def _forward(r: _Rank, out: list, mb: int, c: int) -> None:
    pre, post, layers = r.chunk(c)
    ev = dict(rank=r.rank, microbatch=mb, itemsize=r.item)
    for row in batch_rows(r.cfg, pre, post) if r.cfg.megatron_lm_loop and r.tp > 1 else ():
        _event(out, **dict(ev, itemsize=4), phase="data", **row)
    fwd = dict(ev, phase="forward")
    _fsdp(r, out, mb, "forward", "embedding")
    if pre and r.tp > 1:  # sp without learned positions: reduce-scattered to [s/tp]
        scatter = r.sp and r.cfg.model.position_embedding_type != "learned_absolute"
        _event(out, **fwd, kind="sp" if scatter else "tp",
               op="reduce_scatter" if scatter else "all_reduce",
               site="VocabParallelEmbedding.forward:output", module="embedding.word_embeddings",
               split="embedding rows, vocabulary range",
               shape=r.full if scatter else [r.b, r.local, r.full[2]])
    for i in layers:
        _fsdp(r, out, mb, "forward", f"layers.{i}")
        _layer_forward(r, out, fwd, i)
    for where in ("final_layernorm", "output_layer"):
        _fsdp(r, out, mb, "forward", where)
    if post and r.tp > 1:
        if r.sp:
            _event(out, **fwd, kind="sp", op="all_gather", site="GPTModel.output.forward:input",
                   module="output", split="vocabulary", shape=r.part)
        fused = r.cfg.model.cross_entropy_loss_fusion  # target logits and exp sums in one
        for what in ("max",) + (("target_logit_sum_exp",) if fused else ("target_logit",
                                                                          "sum_exp")):
            _event(out, **dict(fwd, itemsize=4), kind="tp", op="all_reduce", module="output",
                   site=f"vocab_parallel_cross_entropy.forward:{what}", split=_CE,
                   shape=[r.local * (2 if what == "target_logit_sum_exp" else 1), r.b])


def _layer_forward(r: _Rank, out: list, fwd: dict, i: int) -> None:
    """Layer ``i``'s two tensor-parallel regions in forward, context parallelism's K/V exchange
    between them (again, flagged ``recompute``, before its backward under full
    recomputation)."""
    for col, row in (("attention.qkv", "attention.proj"), ("mlp.fc1", "mlp.fc2")):
        if col == "mlp.fc1" and r.moe(i):  # a MoE layer's MLP: its router and dispatcher
            moe_forward(r, i, lambda **f: _event(out, **{**fwd, **f}))
            continue
        if r.sp and r.tp > 1:
            _event(out, **fwd, kind="sp", op="all_gather", module=f"layers.{i}.{col}",
                   site="ColumnParallelLinear.forward:input", split=_COL, shape=r.part)
        if col == "attention.qkv":
            _context_parallel(r, out, fwd, i, backward=False)
        if r.tp > 1:
            _event(out, **fwd, kind="sp" if r.sp else "tp",
                   op="reduce_scatter" if r.sp else "all_reduce", module=f"layers.{i}.{row}",
                   site="RowParallelLinear.forward:output", split=_ROW, shape=r.full)


def _context_parallel(r: _Rank, out: list, ev: dict, i: int, *, backward: bool) -> None:
    """Core attention's exchanges over cp (:func:`.order_cp.cp_rows`)."""
    if r.cp > 1:
        for fields in cp_rows(r.cfg.parallel.cp_comm_type, r, backward=backward):
            _event(out, **dict(ev, kind="cp", module=f"layers.{i}.attention.core",
                               itemsize=r.item), **fields)


def _backward(r: _Rank, out: list, mb: int, c: int) -> None:
    pre, post, layers = r.chunk(c)
    bwd = dict(rank=r.rank, microbatch=mb, itemsize=r.item, phase="backward")
    if post and r.sp:
        _event(out, **bwd, kind="sp", op="all_gather", module="output", split="vocabulary",
               site="GPTModel.output.backward:input (re-gather)", shape=r.part)
    if post and r.tp > 1:
        _event(out, **bwd, kind="sp" if r.sp else "tp",
               op="reduce_scatter" if r.sp else "all_reduce", module="output",
               site="GPTModel.output.backward:input_grad", split="vocabulary", shape=r.full)
    for i in reversed(layers):
        if r.cfg.recompute == "full":  # the re-run (FSDP: its hooks first, pre-backward after)
            _fsdp(r, out, mb, "forward", f"recompute layers.{i}")
            _layer_forward(r, out, dict(bwd, phase="forward", recompute=True), i)
        _fsdp(r, out, mb, "backward", f"layers.{i}")
        for col, row in (("mlp.fc1", "mlp.fc2"), ("attention.qkv", "attention.proj")):
            if col == "mlp.fc1" and r.moe(i):
                moe_backward(r, i, lambda **f: _event(out, **{**bwd, **f}),
                             lambda i=i: _fsdp(r, out, mb, "backward", f"experts layers.{i}"))
                continue
            if r.sp:
                _event(out, **bwd, kind="sp", op="all_gather", module=f"layers.{i}.{row}",
                       site="RowParallelLinear.backward:output_grad", split=_ROW, shape=r.part)
            if col == "attention.qkv":
                if r.cfg.recompute == "selective":  # the checkpointed core runs again first
                    _context_parallel(r, out, dict(bwd, phase="forward", recompute=True), i,
                                      backward=False)
                _context_parallel(r, out, bwd, i, backward=True)
            if r.sp:
                _event(out, **bwd, kind="sp", op="all_gather", module=f"layers.{i}.{col}",
                       site="ColumnParallelLinear.backward:input (re-gather)", split=_COL,
                       shape=r.part, **{"async": True})
            if r.tp > 1:
                _event(out, **bwd, kind="sp" if r.sp else "tp",
                       op="reduce_scatter" if r.sp else "all_reduce",
                       module=f"layers.{i}.{col}", site="ColumnParallelLinear.backward:input_grad",
                       split=_COL, shape=r.full, **{"async": True})
        _fsdp(r, out, mb, "backward", f"after layers.{i}")
    if pre and r.sp and r.cfg.model.position_embedding_type != "learned_absolute":
        _event(out, **bwd, kind="sp", op="all_gather", module="embedding.word_embeddings",
               site="VocabParallelEmbedding.backward:output_grad",
               split="embedding rows, vocabulary range", shape=r.part)
    elif pre and r.sp:
        _event(out, **bwd, kind="sp", op="all_gather", site="Embedding.backward:input_grad",
               module="embedding", split="embeddings, sequence slice", shape=r.part)


def _fsdp(r: _Rank, out: list, mb: int, phase: str, where: str) -> None:
    """Megatron-FSDP's rows at one of its hook points (:mod:`.order_fsdp`)."""
    for row in r.fsdp.rows(mb, phase, where) if r.fsdp is not None else ():
        _event(out, rank=r.rank, microbatch=mb, phase=phase, **row)


def _p2p(r: _Rank, out: list, entry: tuple) -> None:
    """One plan entry's sends and receives (``comm``: a blocking batch named as Megatron names
    it; ``post``: each op on its own, async)."""
    kind, ops = entry
    pairs = [(what, "forward" if msg[0] == "act" else "backward") for what, _, msg in ops]
    for (what, phase), (_, _, msg) in zip(pairs, ops, strict=True):
        _event(out, rank=r.rank, microbatch=msg[1], phase=phase, kind="pp", op=what,
               site=batch_site(pairs if kind == "comm" else [(what, phase)]), shape=r.part,
               itemsize=r.item, **{"async": kind == "post"})


def _buckets(r: _Rank, out: list, chunk: int, phase: str) -> None:
    """A chunk's gradient buckets launched at once (``start_grad_sync`` / ``finish_grad_sync``)."""
    groups = [([b.numel for b in g], g[0].expert) for g in chunk_groups(r.c, r.pp_rank, chunk)]
    for row in bucket_rows(r.cfg, groups, r.cp, phase):
        _event(out, rank=r.rank, microbatch=0, phase=phase, **row)


def _after_schedule(r: _Rank, out: list, synced: list[int]) -> None:
    """Finalize, the optimizer step and Megatron-LM's loop after it (step 1): the chunks the
    schedule did not sync launch their buckets now (the first step's hooks launch none)."""
    cfg, c, p = r.cfg, r.c, r.cfg.parallel
    ev, zero = dict(rank=r.rank, microbatch=0, phase="optimizer"), cfg.distributed_optimizer
    for chunk in [ch for ch in range(r.v) if ch not in synced]:
        _buckets(r, out, chunk, "optimizer")
    if r.sp:
        _event(out, **ev, kind="sp", op="all_reduce", shape=[sp_elems(c, r.pp_rank)],
               site="finalize_model_grads:sequence_parallel_grads")
    tied = not cfg.model.untie_embeddings_and_output_weights
    if tied and r.pp > 1 and r.pp_rank in (0, r.pp - 1):
        _event(out, **ev, kind="emb", op="all_reduce", site="finalize_model_grads:embedding_grads",
               shape=[cfg.padded_vocab_size // r.tp, cfg.model.hidden_size])
    for row in num_tokens_rows(cfg):  # --calculate-per-token-loss
        _event(out, **ev, **row)
    one, loop = dict(ev, shape=[1]), cfg.megatron_lm_loop
    if loop and cfg.rerun_mode != "disabled":
        _event(out, **one, kind="world", op="all_reduce", site="rerun_state_machine:vote",
               split="whether any rank re-runs the step")
    for row in grad_norm_rows(cfg):
        _event(out, **one, **row)
    with_step = cfg.overlap_param_gather_with_optimizer_step  # chunk 0's, launched at once
    n = cfg.num_distributed_optimizer_instances
    _fsdp(r, out, cfg.num_microbatches - 1, "optimizer", "optimizer")  # ZeRO-3's gathers
    for chunk, g in [(k, g) for k in range(r.v) for g in chunk_groups(c, r.pp_rank, k)] \
            if zero and (r.fsdp is None or not r.fsdp.zero3) else []:
        block = p.dp * p.cp // (p.ep if g[0].expert else 1) // n  # one (coalesced) all-gather
        if block > 1 and (not c.overlap_param_gather or (with_step and chunk == 0)):
            _event(out, **ev, kind="dp", op="all_gather", shape=[g[0].numel // block],
                   bytes=sum(b.numel for b in g) // block * r.item,
                   split="parameter bucket, 1/dp contiguous shard",
                   **gather_site(with_step, cfg.use_megatron_fsdp))
    for row in train_step_rows(cfg, r.pp_rank) + after_step_rows(cfg, r.tp * r.pp):
        _event(out, **ev, **row)  # the agreements, the loss; Megatron-LM's loop, the exit vote
    if cfg.model.num_experts is not None and cfg.parallel.world_size > 1:  # paraloom's log
        _event(out, **dict(ev, shape=[3 + cfg.model.num_layers * cfg.model.num_experts]),
               kind="world", op="all_reduce", site="train_step:moe_stats", itemsize=8,
               split="MoE aux/z losses, drops, tokens/expert")


def step_one_events(cfg: TrainConfig, c: CommConfig, rank: int, *, overlap_p2p: bool) -> list[dict]:
    """Rank ``rank``'s communication events of step 1, in launch order (ledger fields:
    ``paraloom.report.table`` renders them). ``c``: the run's view; ``overlap_p2p``: the
    overlapped p2p plan (gloo) or blocking batches."""
    check_supported(cfg)
    r, out = _Rank(cfg, c, rank), []
    schedule = cfg.schedule or "none"
    plan = p2p_plan(schedule, r.pp, cfg.num_microbatches, r.pp_rank, r.v,
                    overlap=overlap_p2p and r.pp > 1)
    # Megatron-LM's grad_sync_func (--align-grad-reduce): the schedule launches the buckets of
    # 1F1B stages after the first at its end, and of each interleaved chunk after the backward
    # of virtual microbatch k + pp_rank where k is the chunk's last (runtime._backward)
    schedule_syncs = cfg.overlap_grad_reduce and cfg.align_grad_reduce and (
        schedule == "interleaved" or (schedule == "1f1b" and r.pp_rank > 0))
    backwards = [(e[1], e[2]) for e in plan if e[0] == "B"]
    synced: list[int] = []
    done, fsdp = 0, cfg.use_megatron_fsdp  # Megatron-FSDP (pp = 1): its own hooks
    for entry in plan:
        if entry[0] in ("comm", "post"):
            _p2p(r, out, entry)
        elif entry[0] == "F":
            _forward(r, out, entry[1], entry[2])
        elif entry[0] == "B":
            _backward(r, out, entry[1], entry[2])
            done += 1
            if fsdp:  # Megatron-FSDP (pp = 1) reduces from its own hooks
                synced = [0]
                _fsdp(r, out, entry[1], "backward", "end")
            g = done - 1 - r.pp_rank
            if schedule == "interleaved" and schedule_syncs and g >= 0 \
                    and backwards[g][0] == cfg.num_microbatches - 1 \
                    and backwards[g][1] not in synced:
                synced.append(backwards[g][1])
                _buckets(r, out, backwards[g][1], "backward")
    for chunk in range(r.v) if schedule_syncs else ():  # "launch any remaining reductions"
        if chunk not in synced:
            synced.append(chunk)
            _buckets(r, out, chunk, "backward")
    _after_schedule(r, out, synced)
    return out
