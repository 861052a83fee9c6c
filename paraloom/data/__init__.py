"""The data a run reads: the bundled corpus and text files (:mod:`.corpus`), tokenizers and
Megatron's indexed datasets (:mod:`.tokenizer`, :mod:`.indexed_dataset`; ``paraloom preprocess``
writes them, :mod:`.preprocess`), the token stream built from any of them (:mod:`.stream`), the
size checks made before ranks start (:mod:`.checks`), and layout-independent batches
(:mod:`.batches`)."""

from .batches import Corpus, eval_batches, microbatches
from .checks import check_data
from .corpus import DEFAULT_CORPUS, HOLDOUT, load_corpus, min_bytes
from .stream import load_tokens

__all__ = ["Corpus", "eval_batches", "microbatches", "check_data", "DEFAULT_CORPUS", "HOLDOUT",
           "load_corpus", "min_bytes", "load_tokens"]
