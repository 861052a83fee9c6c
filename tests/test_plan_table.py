"""``paraloom plan --table``: one rank's step-1 communication order derived from the layout
alone equals, row for row, what ``paraloom table RUN --step 1`` shows for the same flags run
small (parallel type, split object, primitive, trigger location), on every rank of each
layout; and it prints at full size, where nothing can run."""

from __future__ import annotations

import json
import re

import pytest

from paraloom.commands import main

KEYS = ("parallel_type", "split_object", "primitive", "trigger_location")
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
         "--global-batch-size", "4", "--micro-batch-size", "1", "--steps", "1"]
LAYOUTS = {
    "tp": ["--tp", "2", "--pp", "1", "--dp", "1"],
    "sp": ["--tp", "2", "--pp", "1", "--dp", "1", "--sequence-parallel"],
    # Megatron's fused cross entropy: the target logits and exponential sums in one all-reduce
    "sp, fused cross entropy": ["--tp", "2", "--pp", "1", "--dp", "1", "--sequence-parallel",
                                "--cross-entropy-loss-fusion"],
    "pp with vpp": ["--tp", "2", "--pp", "2", "--dp", "1", "--vpp", "2", "--layers", "4"],
    "dp with the distributed optimizer": ["--tp", "2", "--pp", "1", "--dp", "2",
                                          "--distributed-optimizer", "--steps", "2"],
    # --overlap-param-gather: step 1 gathers no parameters (the pre-hooks start after it)
    "pp with dp, overlapped parameter gather": ["--tp", "1", "--pp", "2", "--dp", "2",
                                                "--distributed-optimizer",
                                                "--overlap-param-gather"],
    # the second stage's buckets launched by the schedule (Megatron-LM's grad_sync_func)
    "pp with dp": ["--tp", "1", "--pp", "2", "--dp", "2"],
    # --calculate-per-token-loss: the token count broadcast over pp, summed over dp
    "pp with dp, per-token loss": ["--tp", "1", "--pp", "2", "--dp", "2",
                                   "--calculate-per-token-loss"],
    # --exit-duration-in-mins: the vote after the timers' barriers, before the last barrier
    "dp, the exit vote": ["--tp", "1", "--pp", "1", "--dp", "2", "--exit-duration-in-mins",
                          "60"],
    # rotary positions: the embedding reduce-scattered; the layers re-run before backward
    "llama, sp, full recomputation": ["--arch", "llama", "--tp", "2", "--pp", "1", "--dp", "1",
                                      "--sequence-parallel", "--recompute", "full"],
    # the K/V ring between each layer's regions; gradients reduced over dp x cp
    "cp ring with tp": ["--tp", "2", "--pp", "1", "--dp", "1", "--cp", "2"],
    # Ulysses: Q, K, V to head shards and the output back, each way; re-run by recomputation
    "cp a2a, selective recomputation": ["--tp", "1", "--pp", "1", "--dp", "1", "--cp", "2",
                                        "--cp-comm-type", "a2a", "--recompute", "selective"],
    # hierarchical cp: Ulysses in pairs of consecutive cp ranks around the ring across them
    "cp a2a+p2p": ["--tp", "1", "--pp", "1", "--dp", "1", "--cp", "4", "--cp-comm-type",
                   "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
    # chunk 0's parameter all-gather launched by its own optimizer step (async), step 1 too
    "interleaved dp, gather with the optimizer step": [
        "--tp", "1", "--pp", "2", "--dp", "2", "--vpp", "2", "--layers", "4",
        "--distributed-optimizer", "--overlap-param-gather",
        "--overlap-param-gather-with-optimizer-step"],
    "cp ring, tp, selective recomputation": ["--tp", "2", "--pp", "1", "--dp", "1", "--cp", "2",
                                             "--recompute", "selective"],
    # mixture of experts: the dispatchers' exchanges (their rows follow the routing: compared
    # without the recorded split sizes), the experts' buckets and grad norm, the stats' sum
    "moe alltoall, tp with sp, shared expert overlapped": [
        "--tp", "2", "--pp", "1", "--dp", "2", "--ep", "2", "--sequence-parallel",
        "--num-experts", "4", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
        "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"],
    "moe allgather, tp with sp, shared expert, distributed optimizer": [
        "--tp", "2", "--pp", "1", "--dp", "2", "--ep", "2", "--sequence-parallel",
        "--num-experts", "4", "--disable-bias-linear", "--moe-shared-expert-intermediate-size",
        "64", "--distributed-optimizer"],
    "moe alltoall, experts replicated over dp, full recomputation": [
        "--tp", "1", "--pp", "1", "--dp", "4", "--ep", "2", "--num-experts", "4",
        "--moe-token-dispatcher-type", "alltoall", "--recompute", "full"],
    "moe allgather with pp, every other layer": [
        "--tp", "1", "--pp", "2", "--dp", "2", "--ep", "2", "--num-experts", "4", "--layers",
        "4", "--moe-layer-freq", "2"],
    # under cp: the aux loss's counts summed over tp x cp (kind cp), ep carved out of dp x cp
    "moe alltoall with cp, ep over dp x cp": [
        "--tp", "1", "--pp", "1", "--cp", "2", "--dp", "2", "--ep", "4", "--num-experts", "4",
        "--moe-token-dispatcher-type", "alltoall"],
    "moe allgather, tp with sp and cp, shared expert": [
        "--tp", "2", "--pp", "1", "--cp", "2", "--dp", "1", "--ep", "2", "--sequence-parallel",
        "--num-experts", "4", "--disable-bias-linear", "--moe-shared-expert-intermediate-size",
        "64"],
    # padded to capacity: fixed rows (the splits in the table), no token counts exchanged
    "moe alltoall padded to capacity": [
        "--tp", "1", "--pp", "1", "--dp", "4", "--ep", "2", "--num-experts", "4",
        "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.0",
        "--moe-pad-expert-input-to-capacity"],
    # Megatron-FSDP: ZeRO-2's reduce-scatter after every microbatch, the first forward's
    # unsharding gathers, its own layout's bucket sizes
    "megatron-fsdp optim_grads, tp with sp": [
        "--tp", "2", "--pp", "1", "--dp", "2", "--sequence-parallel", "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy", "optim_grads"],
    # ZeRO-3: each layer's parameters gathered at its forward and backward hooks (prefetching
    # the rest), its gradients reduce-scattered after its backward, all gathered after the step;
    # fully recomputed, the re-run's hooks inside the backward, its pre-backward after it
    "megatron-fsdp optim_grads_params, tp with sp, full recomputation": [
        "--tp", "2", "--pp", "1", "--dp", "2", "--sequence-parallel", "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy", "optim_grads_params", "--recompute", "full"],
    # ZeRO-3 with experts: each layer's dense and expert buckets (the latter over edp) in
    # Megatron-FSDP's group order, one optimizer's gradient norm
    "megatron-fsdp optim_grads_params, experts over edp": [
        "--tp", "1", "--pp", "1", "--dp", "4", "--ep", "2", "--num-experts", "4",
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
    # hybrid sharding: ZeRO-2's reduce-scatter in a block of 2 every microbatch, the summed
    # pieces all-reduced across the blocks after the last
    "megatron-fsdp optim_grads, two instances": [
        "--tp", "1", "--pp", "1", "--dp", "4", "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy", "optim_grads",
        "--num-distributed-optimizer-instances", "2"],
    # each bucket reduce-scattered in a block of 2 dp ranks, its shard all-reduced across
    "dp with two distributed-optimizer instances": [
        "--tp", "1", "--pp", "1", "--dp", "4", "--distributed-optimizer", "--bucket-size", "700",
        "--num-distributed-optimizer-instances", "2"],
}


def _rows(capsys, argv: list[str], keep: bool = False) -> list[tuple]:
    """The rows' KEYS; an all-to-all's or uneven gather's row counts (the routing's) cut off,
    unless ``keep`` (padded to capacity: the counts are known and compared)."""
    assert main(argv) == 0, capsys.readouterr().err
    rows = json.loads(capsys.readouterr().out)["rows"]
    return [tuple(r[k] if k != "split_object" or keep else re.sub(r"; rows .*$", "", r[k])
                  for k in KEYS) for r in rows]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_table_is_the_recorded_table_row_for_row(name, tmp_path, capsys):
    flags = SMALL + LAYOUTS[name]
    run = tmp_path / "run"
    assert main(["train", *flags, "--out", str(run)]) == 0
    capsys.readouterr()
    world = json.loads((run / "config.json").read_text())["parallel"]
    keep = "--moe-pad-expert-input-to-capacity" in flags
    for rank in range(world["tp"] * world["pp"] * world["dp"] * world["cp"]):
        want = _rows(capsys, ["table", str(run), "--step", "1", "--rank", str(rank),
                              "--format", "json"], keep)
        got = _rows(capsys, ["plan", *flags, "--table", "--rank", str(rank), "--format",
                             "json"], keep)
        assert want, (name, rank)
        if rank == 0:  # the folder's own configuration gives the same
            assert _rows(capsys, ["plan", str(run), "--table", "--format", "json"],
                         keep) == want
        assert got == want, (name, rank, next(
            (i, g, w) for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w))


def test_plan_table_at_full_size_and_its_refusals(capsys):
    gpt3 = ["plan", "--gpus", "1024", "--layers", "96", "--hidden", "12288", "--heads", "96",
            "--seq-len", "2048", "--vocab", "51200", "--global-batch-size", "1536",
            "--micro-batch-size", "1", "--tp", "8", "--pp", "16", "--dtype", "bf16",
            "--sequence-parallel", "--table"]
    assert main(gpt3 + ["--rank", "1023", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    # the last stage: 6 layers x 6 sp rows per microbatch and direction, 192 microbatches
    sp = [r for r in rows if r["parallel_type"] == "sp" and r["phase"] != "optimizer"]
    assert len(sp) == 192 * (6 * 4 + 1 + 6 * 6 + 2)
    assert rows[0]["bytes"] == 2048 // 8 * 12288 * 2  # an activation from the previous stage
    # a MoE GPT-3 (8 experts, every layer): each of its layers' allgather dispatcher over tp
    moe = gpt3 + ["--num-experts", "8", "--disable-bias-linear"]
    assert main(moe + ["--rank", "1023", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len([r for r in rows if r["parallel_type"] == "ep" and r["phase"] == "forward"]) \
        == 192 * 6 * 4  # routing map, probabilities, tokens; the outputs' reduce-scatter
    assert rows[-1]["trigger_location"] == "optimizer · train_step moe stats"
    assert main(moe + ["--moe-expert-capacity-factor", "1.0"]) == 2
    assert "plan --table does not derive the order of --moe-expert-capacity-factor" in \
        capsys.readouterr().err
    assert main(gpt3 + ["--rank", "1024"]) == 2
    assert "--rank 1024: the layout has ranks 0-1023" in capsys.readouterr().err
