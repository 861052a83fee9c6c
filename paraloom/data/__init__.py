"""Tokenizers and Megatron's indexed dataset format: ``paraloom preprocess`` writes it,
``paraloom train/eval --data-path`` read it (:mod:`.stream` builds the token stream)."""

__all__ = ["indexed_dataset", "tokenizer", "stream", "preprocess"]
