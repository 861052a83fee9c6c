"""``paraloom train``: every 3D layout trains the same model; resume and reshard continue it.

Each layout is a fresh local world (``launch.spawn`` forks from this process) running the real
training loop; the per-step losses and gradient norms in metrics.jsonl are compared.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from conftest import assert_same_metrics, layout_config, run_training

from paraloom.config import ModelConfig, ParallelConfig, TrainConfig
from paraloom.run_folder import read_json_lines

MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_layers=8, num_attention_heads=4,
                    seq_length=16)
BASE = TrainConfig().replace(parallel=ParallelConfig(), model=MODEL,
                             global_batch_size=8, micro_batch_size=1, steps=5, lr=3e-3,
                   warmup_steps=1, save_every=0, ledger_steps=1, timeout_s=60)


def train(tmp_path, name, **layout) -> list[dict]:
    return run_training(layout_config(BASE, tmp_path / name, **layout))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), "single")


@pytest.mark.parametrize("layout", [
    dict(tp=2, pp=2, dp=2, sp=True, vpp=2),
    dict(tp=2, pp=1, dp=2, sp=True),
    dict(tp=1, pp=4, dp=1, vpp=2),
    dict(tp=4, pp=1, dp=1, sp=True),
    dict(tp=1, pp=1, dp=4),
    dict(tp=2, pp=2, dp=1, distributed_optimizer=False),
    dict(tp=1, pp=2, dp=2, distributed_optimizer=True),
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_layout_trains_the_same_model(tmp_path, reference, layout):
    got = train(tmp_path, "run", **layout)
    assert_same_metrics(got, reference)
    assert got[-1]["loss"] < got[0]["loss"]  # and it learns
    # the compute spans: a pipeline's stages, or on one stage each microbatch (no schedule)
    sites = {e["site"] for e in read_json_lines(tmp_path / "run" / "ledger.jsonl")
             if e["op"] == "compute"}
    prefix = "pipeline." if layout["pp"] > 1 else "microbatch."
    assert {prefix + "forward", prefix + "backward"} <= sites, sites
    assert not any(s.startswith("microbatch." if layout["pp"] > 1 else "pipeline.")
                   for s in sites)


def test_eval_gives_the_same_loss_under_any_layout(tmp_path, capfd):
    from paraloom.commands import main
    train(tmp_path, "run", tp=2, pp=2, steps=2, save_every=2)
    capfd.readouterr()
    results = []
    for layout in (["--tp", "1"], ["--tp", "4", "--sequence-parallel"], ["--pp", "2", "--dp", "2"]):
        assert main(["eval", "--resume", str(tmp_path / "run"), "--batches", "2", *layout]) == 0
        line = [x for x in capfd.readouterr().out.splitlines() if x.startswith("{")][-1]
        results.append(json.loads(line))
    assert results[0]["step"] == 2 and results[0]["tokens"] == 2 * 8 * MODEL.seq_length
    for r in results[1:]:
        assert r["loss"] == pytest.approx(results[0]["loss"], rel=1e-5)
    assert main(["eval", "--resume", str(tmp_path / "nowhere")]) == 2


def test_learning_rate_warms_up_linearly_then_decays_to_min_lr_on_the_last_step():
    from paraloom.training.lr_schedule import learning_rate
    lr = [learning_rate(s, lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=20) for s in range(20)]
    assert lr[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # (step + 1) / warmup
    assert lr[4] == pytest.approx(1.0)  # the cosine starts at the peak
    assert lr[19] == pytest.approx(0.1)  # and ends at min_lr on the last step
    assert lr[4 + 15 // 2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 15)))
    assert all(a > b for a, b in zip(lr[4:], lr[5:], strict=False))  # strictly decreasing
    assert learning_rate(0, lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=1) == 1.0
    assert learning_rate(50, lr=1.0, min_lr=0.2, warmup_steps=2, total_steps=10) == \
        pytest.approx(0.2)  # past the schedule: min_lr


def test_megatron_lm_learning_rate_counts_steps_as_its_scheduler():
    """``--megatron-lr-schedule`` (a Megatron-LM command line's): iteration k at Megatron's
    ``num_steps = k - 1`` -- warm-up from 0, then ``(num_steps - W) / (T - W)`` -- for linear,
    cosine and constant decay (formulas of Megatron-Core's ``OptimizerParamScheduler``)."""
    from paraloom.training.lr_schedule import learning_rate

    def lrs(style, warmup, total=10):
        return [learning_rate(s, lr=1.0, min_lr=0.1, warmup_steps=warmup, total_steps=total,
                              style=style, megatron=True) for s in range(total)]
    assert lrs("linear", 0) == pytest.approx([1.0 - 0.09 * s for s in range(10)])
    assert lrs("linear", 2)[:4] == pytest.approx([0.0, 0.5, 1.0, 1.0 - 0.9 / 8])
    assert lrs("cosine", 2)[3] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 8)))
    assert lrs("constant", 2) == pytest.approx([0.0, 0.5] + [1.0] * 8)
    paraloom = [learning_rate(s, lr=1.0, min_lr=0.1, warmup_steps=0, total_steps=10,
                              style="linear") for s in range(10)]
    assert paraloom[0] == 1.0 and paraloom[-1] == pytest.approx(0.1)  # its own count
    # --lr-warmup-init, a fractional warm-up (--lr-warmup-fraction x --lr-decay-iters: 0.01 x
    # 320 = 3.2 iterations, as Megatron counts samples) and the decay's end before the run's
    assert [learning_rate(s, lr=1.0, min_lr=0.0, warmup_steps=3.2, total_steps=320,
                          style="linear", megatron=True, warmup_init=0.2) for s in (0, 3, 4)] \
        == pytest.approx([0.2, 0.2 + 0.8 * 3 / 3.2, 1 - 0.8 / 316.8])
    assert learning_rate(12, lr=1.0, min_lr=0.1, warmup_steps=0, total_steps=10,
                         style="linear", megatron=True) == 0.1


def test_megatron_lm_schedule_flags_resolve_and_refuse():
    """``--lr-warmup-fraction`` resolves against ``--lr-decay-iters`` (else the run's steps),
    never together with ``--lr-warmup-iters``; the default warm-up stays 5."""
    from paraloom.config import OptimConfig
    assert OptimConfig().warmup_steps == 5
    assert OptimConfig(warmup_fraction=0.01, decay_steps=320).schedule(1000) == \
        pytest.approx((3.2, 320))
    assert OptimConfig(warmup_fraction=0.5).schedule(10) == (5.0, 10)
    with pytest.raises(ValueError, match="--lr-warmup-fraction 0.1 and --lr-warmup-iters 3 "
                                         "both set the warm-up"):
        OptimConfig(warmup_fraction=0.1, warmup_steps=3)
    with pytest.raises(ValueError, match=r"decay_steps \(--lr-decay-iters\) must be a positive"):
        OptimConfig(decay_steps=0)
    with pytest.raises(ValueError, match="warmup_init"):
        OptimConfig(lr=1e-3, warmup_init=1e-2)


def test_init_method_std_scales_every_initial_weight():
    """``--init-method-std`` (Megatron's): the counter-based initialiser draws the same normals,
    scaled -- a block's output projections by ``std / sqrt(2 layers)`` too -- and biases and
    norms stay as they are."""
    from paraloom.data import Corpus, load_corpus
    from paraloom.mesh import ParallelMesh
    from paraloom.training.train import build

    def params(std):
        cfg = TrainConfig().replace(parallel=ParallelConfig(), model=ModelConfig(
            vocab_size=256, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=16,
            init_std=std), global_batch_size=2, micro_batch_size=1, steps=1, save_every=0)
        run = build(cfg, ParallelMesh(cfg.parallel),
                    Corpus(load_corpus(cfg.data.file), cfg.model.seq_length, cfg.seed))
        return dict(run.chunks[0].named_parameters())
    base, half = params(0.02), params(0.01)
    scaled = [n for n, p in base.items() if p.dim() > 1]
    assert "layers.0.attention.proj.weight" in scaled and len(scaled) > 6
    for name in scaled:
        assert (half[name] * 2).allclose(base[name]), name
    for name in set(base) - set(scaled):
        assert half[name].equal(base[name]), name
    # an output projection at std / sqrt(2 x 2 layers), an input one at std
    assert float(base["layers.1.mlp.fc2.weight"].detach().std()) == pytest.approx(0.01, rel=0.1)
    assert float(base["layers.1.mlp.fc1.weight"].detach().std()) == pytest.approx(0.02, rel=0.1)


def test_fused_cross_entropy_trains_the_same_model_and_checks_exactly(tmp_path, reference,
                                                                        capsys):
    """``--cross-entropy-loss-fusion`` (Megatron's native fused cross entropy): every layout
    trains what one process trains with it; the loss is the unfused one, the logits' gradient
    rounded to bf16; the target logits and exponential sums go in one tp all-reduce of
    ``[2s, b]`` after the max, and ``check`` agrees exactly."""
    from paraloom.commands import main
    base = BASE.replace(model=replace(MODEL, cross_entropy_loss_fusion=True))
    one = run_training(layout_config(base, tmp_path / "one"))
    assert one[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-6)
    assert one[-1]["grad_norm"] != pytest.approx(reference[-1]["grad_norm"], rel=1e-6)
    for name, layout in (("tp2-sp", dict(tp=2, dp=2, sp=True)), ("tp2-pp2", dict(tp=2, pp=2))):
        assert_same_metrics(run_training(layout_config(base, tmp_path / name, **layout)), one)
        events = [e for e in read_json_lines(tmp_path / name / "ledger.jsonl")
                  if e["site"].startswith("vocab_parallel_cross_entropy")]
        losses = [e for e in events if e["rank"] == events[0]["rank"]]  # a last-stage rank
        assert [(e["site"].split(":")[1], e["shape"]) for e in losses[:2]] == [
            ("max", [16, 1]), ("target_logit_sum_exp", [32, 1])]
        assert len(losses) == 2 * 8 // layout.get("dp", 1)  # two per microbatch, not three
        assert main(["check", str(tmp_path / name), "--step", "1"]) == 0, capsys.readouterr()


def test_per_token_loss_trains_the_same_model_and_checks_exactly(tmp_path, reference, capsys):
    """``--calculate-per-token-loss`` (Megatron's): each microbatch's summed loss is
    differentiated as it is, the gradients summed over dp and divided at the end of
    ``finalize_model_grads`` by the step's token count (int32 ``[]``: broadcast from the last
    stage over pp, summed over dp x cp). Equal windows make it the average it replaces: one
    process, and every layout with it, trains what the reference trains (a rank dividing by
    another count would not); ``check`` agrees exactly."""
    from paraloom.commands import main
    base = BASE.replace(calculate_per_token_loss=True)
    one = run_training(layout_config(base, tmp_path / "one"))
    assert_same_metrics(one, reference)
    for name, layout in (("pp2-dp2-distopt", dict(pp=2, dp=2, distributed_optimizer=True)),
                         ("cp2-dp2", dict(cp=2, dp=2)), ("tp2-sp-pp2", dict(tp=2, sp=True, pp=2))):
        assert_same_metrics(run_training(layout_config(base, tmp_path / name, **layout)), one)
        events = [e for e in read_json_lines(tmp_path / name / "ledger.jsonl")
                  if e["site"] == "finalize_model_grads:num_tokens" and e["step"] == 1]
        pp, dp_cp = layout.get("pp", 1), layout.get("dp", 1) * layout.get("cp", 1)
        world = pp * dp_cp * layout.get("tp", 1)
        assert sorted(e["op"] for e in events) == sorted(
            ["broadcast"] * world * (pp > 1) + ["all_reduce"] * world * (dp_cp > 1)), name
        assert {(e["dtype"], e["bytes"], tuple(e["shape"])) for e in events} == \
            {("int32", 4, ())}
        assert main(["check", str(tmp_path / name), "--step", "1"]) == 0, capsys.readouterr()


def test_megatron_lm_logged_statistics_are_the_one_process_values_and_check_exactly(
        tmp_path, capsys):
    """``--log-params-norm`` and ``--log-num-zeros-in-grad`` (Megatron-LM's): every layout
    reports the parameter norm one process reports (each parameter once: no tp duplicates, no
    tied copy; the distributed optimizer's shards summed over dp) and the same count of zero
    gradients within 1% (the untied input embedding's rows of absent tokens, ~7,000; under cp
    the attention's chunked softmax rounds a few more gradients to exactly zero), and ``check``
    agrees exactly with their all-reduces."""
    from paraloom.commands import main
    base = BASE.replace(model=replace(MODEL, untie_embeddings_and_output_weights=True),
                        log_params_norm=True, log_num_zeros_in_grad=True, steps=2)
    one = run_training(layout_config(base, tmp_path / "one"))
    assert all(m["num_zeros"] > 1000 for m in one)
    for name, layout in (("tp2-pp2", dict(tp=2, pp=2)), ("dp2-cp2", dict(dp=2, cp=2)),
                         ("pp2-dp2-distopt", dict(pp=2, dp=2, distributed_optimizer=True))):
        got = run_training(layout_config(base, tmp_path / name, **layout))
        assert_same_metrics(got, one)
        for a, b in zip(got, one, strict=True):
            assert a["params_norm"] == pytest.approx(b["params_norm"], rel=1e-5), name
            assert abs(a["num_zeros"] - b["num_zeros"]) <= 0.01 * b["num_zeros"], (name, a, b)
        assert main(["check", str(tmp_path / name), "--step", "1"]) == 0, capsys.readouterr()


def test_exit_duration_stops_every_rank_after_the_vote_and_resumes(tmp_path, capsys):
    """``--exit-duration-in-mins``: after every step the ranks take the MAX of "past the limit"
    over the world (an int32 ``[1]`` all-reduce, after the loop's timer barriers); past it, the
    run saves a checkpoint and stops there, and a resume trains the rest. ``check`` agrees
    exactly with the vote in every step."""
    from paraloom.commands import main
    late = layout_config(BASE.replace(exit_duration_mins=1e-9, save_every=100), tmp_path / "late",
                         tp=2, dp=2)
    got = run_training(late)
    summary = json.loads((tmp_path / "late" / "summary.json").read_text())
    assert [m["step"] for m in got] == [1] and got[0]["exit"] is True
    assert (summary["steps"], summary["planned_steps"]) == (1, 5)
    assert (tmp_path / "late" / "checkpoints" / "step_1").is_dir()
    votes = [e for e in read_json_lines(tmp_path / "late" / "ledger.jsonl")
             if e["site"] == "checkpoint_and_decide_exit:exit_duration"]
    assert sorted(e["rank"] for e in votes) == [0, 1, 2, 3]
    assert {(e["op"], e["kind"], e["dtype"], e["bytes"], e["phase"]) for e in votes} == {
        ("all_reduce", "world", "int32", 4, "optimizer")}
    assert main(["check", str(tmp_path / "late"), "--step", "1"]) == 0, capsys.readouterr()
    rest = run_training(late.replace(resume=str(tmp_path / "late"), exit_duration_mins=60.0,
                                     out=str(tmp_path / "rest")))
    assert [m["step"] for m in rest] == [2, 3, 4, 5] and not any("exit" in m for m in rest)
