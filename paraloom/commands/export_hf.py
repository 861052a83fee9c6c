"""``paraloom export-hf RUN_DIR OUT_DIR``: a run's latest checkpoint as a Hugging Face GPT-2 or
Llama folder (:mod:`paraloom.training.hf_export`)::

    paraloom export-hf runs/latest gpt2-out
    python -c "import transformers as t; t.GPT2LMHeadModel.from_pretrained('gpt2-out')"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..training.hf_export import export_hf

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="paraloom export-hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run folder or checkpoint folder (its latest checkpoint)")
    p.add_argument("out_dir", help="folder to write model.safetensors, config.json and the "
                                   "run's tokenizer files into")
    args = p.parse_args(argv)
    try:
        ckpt, tokenizer = export_hf(args.run_dir, args.out_dir)
    except ImportError as err:
        print(f"paraloom export-hf: error: {err}; install the extra: pip install "
              f"'paraloom[hf]'", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"paraloom export-hf: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {Path(args.out_dir) / 'model.safetensors'} and config.json from {ckpt}; "
          f"{tokenizer}")
    return 0
