"""``paraloom plan`` reads ``paraloom train``'s flags: the run it plans is the run train makes of
the same command line (round trip through ``config.json``), Megatron-LM's argument list with
``--gpus N`` as the world included."""

from __future__ import annotations

import json

import pytest

from paraloom.analysis.view import comm_view, view_of_saved
from paraloom.commands import main
from paraloom.commands.plan import main as plan_main
from paraloom.commands.train import parser as train_parser
from paraloom.commands.train_flags import config_from_args
from paraloom.config import TrainConfig

SMALL = ["--tp", "2", "--pp", "1", "--dp", "1", "--layers", "2", "--hidden", "32", "--heads",
         "2", "--seq-len", "16", "--global-batch-size", "2", "--micro-batch-size", "1",
         "--steps", "1", "--swiglu", "--vocab", "300", "--recompute", "selective"]

MEGATRON_LM_MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
                     "--seq-length", "128", "--max-position-embeddings", "128",
                     "--global-batch-size", "16", "--bf16", "--train-iters", "10", "--lr", "1e-4",
                     "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257",
                     "--transformer-impl", "local"]
MEGATRON_LM = [*MEGATRON_LM_MODEL, "--micro-batch-size", "1", "--tensor-model-parallel-size",
               "2", "--pipeline-model-parallel-size", "2",
               "--num-layers-per-virtual-pipeline-stage", "2", "--sequence-parallel",
               "--use-distributed-optimizer"]


def _plan_json(capsys, argv: list[str]) -> dict:
    assert plan_main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_of_trains_flags_is_the_run_train_wrote(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--out", str(out)]) == 0
    capsys.readouterr()
    saved = json.loads((out / "config.json").read_text())
    from_flags = _plan_json(capsys, [*SMALL, "--out", str(out), "--gpu", "h100-sxm"])
    from_folder = _plan_json(capsys, [str(out), "--gpu", "h100-sxm"])
    assert from_flags["config"] == saved == from_folder["config"]
    assert comm_view(TrainConfig.from_dict(from_flags["config"])) == view_of_saved(saved)
    for key in ("parameters", "memory_per_gpu_bytes", "comm_bytes_per_step", "step_time"):
        assert from_flags[key] == from_folder[key], key
    # the derived settings are the configuration's: SwiGLU width, Megatron's padding at tp 2
    view = view_of_saved(saved)
    assert (view.ffn, view.vocab, view.sequence_parallel) == (64, 512, False)


def test_megatron_lm_command_line_with_gpus_is_trains_layout(capsys):
    args = train_parser().parse_args([*MEGATRON_LM, "--nprocs", "16"])
    args.megatron_lm_spelt = ["--num-layers"]  # a Megatron-LM command line, as train sees it
    want, _ = config_from_args(args)
    got = _plan_json(capsys, [*MEGATRON_LM, "--gpus", "16", "--gpu", "h100-sxm"])
    assert got["config"] == want.to_dict()
    p = want.parallel
    assert (p.tp, p.pp, p.dp, p.vpp, want.dtype) == (2, 2, 4, 2, "bf16")
    assert not want.overlap_grad_reduce  # Megatron-LM's default, as train applies it
    assert got["gpus"] == 16 and got["global_batch_size"] == 16
    assert got["config"]["model"]["vocab_size"] == 50257
    assert comm_view(want).vocab == 50432  # 50257 padded to a multiple of 128 * tp 2


@pytest.mark.parametrize("extra, message", [
    (["--gpus", "12"], "--gpus 12 does not match tp*cp*pp*dp = 2*1*2*4 = 16"),
    (["--gpus", "16", "--nprocs", "8"], "--gpus 16 and --nprocs 8 both give the world"),
    (["--gpus", "16", "--fp16"], "--fp16: fp16 training (with its loss scaling) is not "
                                 "implemented"),
    (["--gpus", "16", "--dtype", "fp32"], "--bf16 contradicts --dtype fp32"),
    (["--gpus", "0"], "--gpus must be >= 1, got 0"),
])
def test_plan_refuses_a_world_the_layout_does_not_fill(capsys, extra, message):
    argv = [*MEGATRON_LM, *extra]
    if extra[:2] == ["--gpus", "12"]:
        argv += ["--data-parallel-size", "4"]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_search_reads_the_model_as_train_does(capsys):
    """``--search`` takes the model from train's flags (Megatron-LM's names and ``--bf16``
    included) and refuses the layout flags it tries itself, in either spelling."""
    model = MEGATRON_LM_MODEL
    got = _plan_json(capsys, ["--search", "--gpus", "8", *model, "--top", "3"])
    assert got["layouts_fitting"] > 0 and len(got["ranked"]) == 3
    assert plan_main(["--search", "--gpus", "8", *MEGATRON_LM]) == 2
    err = capsys.readouterr().err
    assert "--tensor-model-parallel-size" in err and "the search tries every value" in err
    bf16 = _plan_json(capsys, ["--search", "--gpus", "8", *model, "--top", "1"])
    fp32 = _plan_json(capsys, ["--search", "--gpus", "8", *[f for f in model if f != "--bf16"],
                               "--top", "1"])
    assert fp32["ranked"][0]["memory_bytes"] > bf16["ranked"][0]["memory_bytes"]
