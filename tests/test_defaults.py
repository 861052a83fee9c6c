"""Megatron-Core's defaults: what ``paraloom train`` turns on, the ``--no-...`` switch of each, and
the rule read from Megatron-Core's own source (the recorded ledger is asserted in test_check.py,
whose shared runs include a default one and a ``--no-async-...`` one)."""

from __future__ import annotations

import re

import pytest
from _megatron_source import megatron_file

from paraloom.commands.train import parser, train_main
from paraloom.commands.train_flags import config_from_args
from paraloom.config import ParallelConfig, TrainConfig


def parse(*flags: str):
    return parser().parse_args(list(flags))


def config(*flags: str) -> TrainConfig:
    return config_from_args(parse(*flags))[0]


def test_megatron_core_rule_read_from_its_source():
    """Megatron-Core 0.19.2's ColumnParallelLinear has no switch: it all-reduces the input
    gradient asynchronously whenever tp > 1 and sequence parallelism is off."""
    text = megatron_file("tensor_parallel/layers.py").read_text()
    rule = re.search(r"self\.allreduce_dgrad = \(\s*(.*?)\s*\)", text, re.S)
    assert rule is not None
    assert rule.group(1).split() == ["world_size", ">", "1", "and", "not",
                                     "self.sequence_parallel", "and", "not",
                                     "self.disable_grad_reduce"]


@pytest.mark.parametrize(("tp", "sp", "want"), [(1, False, False), (2, False, True),
                                                (4, False, True), (2, True, False)])
def test_async_default_follows_megatron_core(tp, sp, want):
    parallel = ParallelConfig(tp=tp, sequence_parallel=sp)
    assert parallel.async_grad_allreduce is None  # "Megatron-Core's rule", kept as given
    assert parallel.uses_async_grad_allreduce is want


def test_default_train_command_runs_async_for_tp_without_sp():
    cfg = config()
    assert (cfg.parallel.tp, cfg.parallel.sequence_parallel) == (2, False)
    assert cfg.parallel.uses_async_grad_allreduce is True
    # the other defaults checked against Megatron (README, "Defaults")
    assert cfg.parallel.gradient_accumulation_fusion is False
    assert cfg.overlap_grad_reduce is True and cfg.bucket_size is None
    assert cfg.distributed_optimizer is False


@pytest.mark.parametrize("flag", ["--no-async-tensor-model-parallel-allreduce",
                                  "--no-async-grad-allreduce"])
def test_each_no_async_switch_turns_it_off(flag):
    cfg = config(flag)
    assert cfg.parallel.async_grad_allreduce is False
    assert cfg.parallel.uses_async_grad_allreduce is False


def test_sequence_parallel_with_the_default_does_not_fail():
    cfg = config("--sequence-parallel")
    assert cfg.parallel.sequence_parallel and not cfg.parallel.uses_async_grad_allreduce


def test_asking_for_both_async_and_sp_is_still_an_error(capsys):
    with pytest.raises(ValueError, match="sequence_parallel=True cannot be combined"):
        ParallelConfig(tp=2, sequence_parallel=True, async_grad_allreduce=True)
    assert train_main(parse("--async-grad-allreduce", "--sequence-parallel")) == 2
    err = capsys.readouterr().err
    assert "async_grad_allreduce" in err and "sequence_parallel" in err
    with pytest.raises(ValueError, match="got 'yes'"):
        ParallelConfig(tp=2, async_grad_allreduce="yes")


def test_explicit_async_on_is_unchanged_and_does_nothing_at_tp1():
    assert config("--async-tensor-model-parallel-allreduce").parallel.uses_async_grad_allreduce
    assert not config("--tp", "1", "--async-grad-allreduce").parallel.uses_async_grad_allreduce


@pytest.mark.parametrize(("flags", "field", "want"), [
    (("--gradient-accumulation-fusion",), "fusion", True),
    (("--gradient-accumulation-fusion", "--no-gradient-accumulation-fusion"), "fusion", False),
    (("--no-grad-accum-fusion",), "fusion", False),
    (("--no-overlap-grad-reduce",), "overlap", False),
    ((), "p2p", None),
    (("--no-overlap-p2p-communication",), "p2p", False),
])
def test_switches_of_the_other_defaults(flags, field, want):
    cfg = config(*flags)
    got = {"fusion": cfg.parallel.gradient_accumulation_fusion,
           "overlap": cfg.overlap_grad_reduce, "p2p": cfg.overlap_p2p_comm}[field]
    assert got is want


def test_overlapped_p2p_on_cuda_is_refused_before_the_ranks_train(monkeypatch):
    """Under torchrun with CUDA (NCCL), an explicit --overlap-p2p-communication is refused while
    the flags are read, and the refusal goes through the world's agreement (every rank stops
    with the message), not as a ValueError raised inside every rank's schedule."""
    from paraloom import device
    from paraloom.training import multinode as nodes
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(device, "cuda_usable", lambda: True)
    refused = []
    monkeypatch.setattr(nodes, "refuse_under_torchrun",
                        lambda prog, error, timeout_s: refused.append(error) or 2)
    monkeypatch.setattr(nodes, "run_under_torchrun", lambda *a, **k: pytest.fail("it ran"))
    # (a world without layout flags is Megatron-LM's: pp 1, where p2p is moot; so pp 2 here)
    assert train_main(parse("--overlap-p2p-communication", "--tp", "2", "--pp", "2")) == 2
    assert "--overlap-p2p-communication is for gloo" in refused[0]
    assert "--no-overlap-p2p-communication" in refused[0]
    ran = []
    monkeypatch.setattr(nodes, "run_under_torchrun", lambda *a, **k: ran.append(a) or 0)
    assert train_main(parse()) == 0 and train_main(parse("--pp", "1", "--dp", "8",
                                                         "--overlap-p2p-communication")) == 0
    assert len(ran) == 2 and len(refused) == 1


def megatron_lm_config(*flags: str) -> TrainConfig:
    """The configuration ``paraloom train FLAGS`` runs with (``main`` marks the spellings)."""
    from paraloom.commands.megatron_lm_flags import megatron_lm_spellings

    flags_parser = parser()
    args = flags_parser.parse_args(list(flags))
    args.megatron_lm_spelt = megatron_lm_spellings(flags_parser, list(flags))
    return config_from_args(args)[0]


@pytest.mark.parametrize("flags", [("--train-iters", "3"), ("--tensor-model-parallel-size", "1"),
                                   ("--num-layers=2",), ("--mock-data",),
                                   ("--use-distributed-optimizer", "--dp", "2")])
def test_a_megatron_lm_command_line_gets_megatron_lm_defaults(flags):
    """One flag spelt as Megatron-LM spells it makes the command line Megatron-LM's: gradient
    reduction after backward, blocking p2p batches, every step in the ledger."""
    cfg = megatron_lm_config(*flags)
    assert (cfg.overlap_grad_reduce, cfg.overlap_p2p_comm, cfg.run.ledger_steps) == \
        (False, False, -1)


@pytest.mark.parametrize("flags", [("--steps", "3"), ("--layers", "2", "--no-overlap-grad-reduce"),
                                   ("--distributed-optimizer", "--dp", "2"), ("--nproc", "4")])
def test_paraloom_spelling_keeps_paraloom_defaults(flags):
    cfg = megatron_lm_config(*flags)
    assert cfg.overlap_p2p_comm is None and cfg.run.ledger_steps == 2
    assert cfg.overlap_grad_reduce == ("--no-overlap-grad-reduce" not in flags)


def test_flags_given_beat_megatron_lm_defaults():
    cfg = megatron_lm_config("--train-iters", "3", "--overlap-grad-reduce",
                             "--overlap-p2p-communication", "--ledger-steps", "2")
    assert (cfg.overlap_grad_reduce, cfg.overlap_p2p_comm, cfg.run.ledger_steps) == \
        (True, True, 2)


def test_the_megatron_lm_defaults_note_names_only_what_it_applied():
    """The note lists Megatron-LM's optimizer defaults one by one, and not one the command line
    gave a value for (it used to print the whole group's text, weight decay 0.01 included,
    under --weight-decay 0.1)."""
    from paraloom.commands.megatron_lm_flags import megatron_lm_spellings

    def note(*flags):
        flags_parser = parser()
        args = flags_parser.parse_args(list(flags))
        args.megatron_lm_spelt = megatron_lm_spellings(flags_parser, list(flags))
        cfg = config_from_args(args)[0]
        return cfg, "; ".join(args.megatron_lm_defaults)

    cfg, text = note("--train-iters", "3")
    assert "weight decay 0.01" in text and "Adam beta2 0.999" in text
    assert cfg.optim.weight_decay == 0.01
    cfg, text = note("--train-iters", "3", "--weight-decay", "0.1", "--adam-beta2", "0.95")
    assert (cfg.optim.weight_decay, cfg.optim.adam_beta2) == (0.1, 0.95)
    assert "weight decay" not in text and "beta2" not in text, text
    assert "linear learning-rate decay" in text and "no warm-up" in text


def test_megatron_lm_interleaving_overlaps_p2p_as_megatron_lm():
    """Megatron-LM overlaps the interleaved schedule's p2p by default (1F1B has no overlap):
    given a Megatron-LM command line with virtual stages, paraloom runs Megatron-Core's
    overlapped interleaved plan (on gloo)."""
    cfg = megatron_lm_config("--pipeline-model-parallel-size", "4", "--num-layers", "8",
                             "--num-layers-per-virtual-pipeline-stage", "1")
    assert cfg.parallel.vpp == 2 and cfg.overlap_p2p_comm is True
    cfg = megatron_lm_config("--pipeline-model-parallel-size", "4", "--num-layers", "8",
                             "--num-layers-per-virtual-pipeline-stage", "1",
                             "--no-overlap-p2p-communication")
    assert cfg.overlap_p2p_comm is False


def test_an_earlier_run_folders_log_interval_was_tensorboards():
    """Before --tensorboard-log-interval, run.log_interval was TensorBoard's: a saved config of
    then resumes with that TensorBoard interval and Megatron-LM's log interval (100); check
    reads its timers' barriers the same way."""
    from paraloom.config.train import migrate
    from paraloom.verify.check import config_from_run

    old = TrainConfig().to_dict()
    old["run"].pop("tensorboard_log_interval")
    old["run"]["log_interval"] = 5
    cfg = TrainConfig.from_dict(migrate(old))
    assert (cfg.run.tensorboard_log_interval, cfg.run.log_interval) == (5, 100)
    assert config_from_run(old).log_interval == 100
    new = TrainConfig().to_dict()
    new["run"]["log_interval"] = 7
    assert TrainConfig.from_dict(migrate(new)).run.log_interval == 7 \
        == config_from_run(new).log_interval
