"""Context parallelism: one sequence split over the ``cp`` ranks, attention across the split.

* :mod:`.split` — Megatron's load-balanced causal split (``get_batch_on_this_cp_rank``): the
  sequence is cut into ``2 * cp`` chunks and cp rank ``r`` holds chunks ``r`` and ``2cp-1-r``, so
  every rank does the same attention work.
* :mod:`.blocks` — attention on one (query chunk, key chunk) block with its log-sum-exp, and the
  block's backward from the merged output (flash-attention's algebra, written out).
* :mod:`.ring` — ``p2p``: K/V blocks passed around the cp ring (cp steps), merged by log-sum-exp;
  backward passes dK/dV around the ring (kind ``cp``).
* :mod:`.all_gather` — ``all_gather``: one all-gather of K,V per layer (Llama 3's CP), its
  backward a reduce-scatter of dK,dV.
* :mod:`.ulysses` — ``a2a`` (DeepSpeed-Ulysses): Q, K, V all-to-all'd from sequence to head
  shards, attention over the whole sequence, the output all-to-all'd back.
* :mod:`.hierarchical` — ``a2a+p2p``: Ulysses inside groups of consecutive cp ranks, the ring
  across the groups.
"""

from .all_gather import all_gather_attention
from .attention import ContextParallelAttention
from .hierarchical import hierarchical_attention
from .ring import ring_attention
from .split import chunk_ids, get_batch_on_this_cp_rank, position_ids, split_sequence
from .ulysses import ulysses_attention

__all__ = ["ContextParallelAttention", "ring_attention", "all_gather_attention",
           "ulysses_attention", "hierarchical_attention", "chunk_ids",
           "get_batch_on_this_cp_rank", "position_ids", "split_sequence"]
