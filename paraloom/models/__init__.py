"""The models, built from the parallel layers: the GPT (:mod:`.gpt`, GPT-2 and Llama shapes, dense
or MoE; blocks in :mod:`.layers`), its non-shape switches (:mod:`.options`), and Hugging Face
GPT-2 / Llama weights in and out (:mod:`.hf`, :mod:`.hf_llama`)."""

from .gpt import GPTModel, TransformerLayer
from .options import ParallelOptions

__all__ = ["GPTModel", "TransformerLayer", "ParallelOptions"]
