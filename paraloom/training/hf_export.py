"""A run's latest checkpoint as a Hugging Face GPT-2 (``GPT2LMHeadModel``), or ``LlamaForCausalLM``
for a Llama-shaped model (``--arch llama``).

Reads the checkpoint in this one process (no ranks: DCP assembles every tensor from its tp
shards, whatever layout wrote it), maps it with :func:`paraloom.models.hf.to_hf_state_dict` and
writes ``OUT_DIR/model.safetensors`` + ``OUT_DIR/config.json``, which
``transformers.GPT2LMHeadModel.from_pretrained(OUT_DIR)`` loads. A run trained with
``--tokenizer DIR`` gets that folder's tokenizer files copied along (``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``, ``vocab.json``, ``merges.txt``: what it
has of them), so ``AutoTokenizer.from_pretrained(OUT_DIR)`` reads the same tokens; a byte-level run
has no tokenizer to copy (its token ids are the bytes)::

    paraloom export-hf runs/latest gpt2-out
    python -c "import transformers as t; t.GPT2LMHeadModel.from_pretrained('gpt2-out')"

bf16 runs export their fp32 master weights (``optim.<name>.master``) when the checkpoint has them.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ..config import ModelConfig, TrainConfig
from ..models.hf import hf_config_from_model, to_hf_state_dict
from .checkpoint import SafeFileSystemReader, find_checkpoint

__all__ = ["load_full_params", "export_hf", "TOKENIZER_FILES"]


VOCAB_TABLES = ("embedding.word_embeddings.weight", "output_layer.weight")
"""The tensors whose rows are the padded vocabulary (the padding follows the writer's tp)."""


def load_full_params(checkpoint: str | Path):
    """``(ModelConfig, {global name: full tensor}, checkpoint)`` of a run or checkpoint folder,
    read in this process without a process group: the model one process holds, its vocabulary
    tables padded as at tp = 1 (the writer's real rows, zero padding rows)."""
    ckpt, meta = find_checkpoint(checkpoint, "RUN_DIR")
    cfg = ModelConfig(**meta["config"]["model"])
    metadata = SafeFileSystemReader(str(ckpt)).read_metadata()
    state = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") or (key.startswith("optim.") and key.endswith(".master")):
            state[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), no_dist=True)
    params = {}
    for key, tensor in state.items():
        if key.startswith("model."):
            name = key.removeprefix("model.")
            params[name] = state.get(f"optim.{name}.master", tensor)
    for name in VOCAB_TABLES:
        if name in params:
            table = params[name]
            params[name] = table.new_zeros((cfg.padded_vocab(1), *table.shape[1:]))
            params[name][: cfg.vocab_size] = table[: cfg.vocab_size]
    return cfg, params, ckpt


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt")


def export_hf(run_dir: str | Path, out_dir: str | Path) -> tuple[Path, str]:
    """Write ``model.safetensors`` and ``config.json`` for ``run_dir``'s latest checkpoint, and
    the run's tokenizer files; returns the checkpoint and a sentence on the tokenizer."""
    from safetensors.torch import save_file  # optional: paraloom[hf]
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR {str(out)!r} exists and is not a folder; give a folder to "
                         f"write model.safetensors and config.json into")
    cfg, params, ckpt = load_full_params(run_dir)
    hf_config = hf_config_from_model(cfg)  # ValueError for a model with no HF architecture
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"OUT_DIR {str(out)!r} cannot be created: {err.strerror}") from None
    save_file(to_hf_state_dict(params, cfg), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
    tokenizer = TrainConfig.from_dict(find_checkpoint(ckpt)[1]["config"]).data.tokenizer
    return ckpt, _copy_tokenizer(tokenizer, out)


def _copy_tokenizer(folder: str | None, out: Path) -> str:
    if folder is None:
        return "no tokenizer (a byte-level run: token ids are bytes)"
    src = Path(folder)
    files = [src / name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not files:
        return (f"tokenizer NOT copied: the run's --tokenizer {folder!r} is not readable here; "
                f"copy its tokenizer.json next to the model yourself")
    for file in files:
        shutil.copyfile(file, out / file.name)
    return f"tokenizer files from {folder}: {', '.join(f.name for f in files)}"
