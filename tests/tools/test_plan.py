"""The memory planner's arithmetic on hand-computed cases (CLI and shared checks:
test_plan_cli.py). Layouts are the run's own configs, built by `plan_args`."""
import dataclasses

import pytest

from megazoo.models import PRESETS, ModelConfig, build_model, count_parameters
from megazoo.plan import (GB, RUNTIME_BYTES, PlanOptions, activation_bytes, block_coefficients,
                          estimate_memory, stage_parameters)
from megazoo.plan.engines import TORCH_HOST_RUNTIME_BYTES
from megazoo.offload import pinned

from helpers.run_args import TOY, plan_args

BLOCK = 12 * 64 * 64 + 13 * 64  # 49,984


def test_stage_parameters_by_hand():
    one = stage_parameters(TOY, tp=1, pp=1)
    assert one["block"] == BLOCK
    assert one["stage"] == 2 * BLOCK + 384 * 64 + 128 * 64 + 128 == count_parameters(TOY)
    two = stage_parameters(TOY, tp=2, pp=1)
    # sharded: 12 h^2 + qkv bias 3h + fc1 bias 4h = 49,856 / 2; replicated: 2 LN (256) + 2 row biases (128)
    assert two["block"] == (12 * 4096 + 7 * 64) // 2 + 4 * 64 + 2 * 64
    pipe = stage_parameters(TOY, tp=1, pp=2)
    assert pipe["first"] == BLOCK + 384 * 64 + 128 * 64
    assert pipe["last"] == BLOCK + 384 * 64 + 128  # tied head copy + final LayerNorm


def test_activation_formula_counts_our_block():
    """Per block, what our block saves (plan_activations.py's table), not the paper's
    s b h (34 + 5 a s / h): our attention is a fused kernel (no s x s softmax kept) and
    dropout is 0 (no masks). TOY is a GPT block: h=64, ffn=256, MHA, learned positions."""
    # s=128, b=2, h=64: s b h = 16,384. tp=1: norms 4 + matmul inputs 4 + qkv 6 + dense
    # input 2 + MLP 8 + 8 = 32.
    def act(**kw):
        return activation_bytes(plan_args(seq_length=128, micro_batch_size=2, **kw))
    assert act()["block"] == 16384 * 32
    assert act(recompute="selective")["block"] == 16384 * 32  # no RoPE, no extra copy: same
    assert act(recompute="full")["block"] == 2 * 16384
    # tp=2 without SP: norms and matmul inputs full (8), the rest (24) halved.
    assert act(tp=2)["block"] == 16384 * (8 + 12)
    # tp=2 with SP: norm inputs halved (2), matmul inputs gathered (4), the rest halved (12).
    assert act(tp=2, sequence_parallel=True)["block"] == 16384 * (2 + 4 + 12)
    # sp=2: everything per s/2 tokens, plus the all-to-all's copy of the attention output.
    assert act(sp=2)["block"] == 8192 * (32 + 2)
    logits = 128 * 2 * 384 * 10  # bf16 logits + fp32 copy + fp32 exp in the loss's forward
    post = 16384 * 4  # final norm input + head input
    assert act()["logits"] == logits and act()["post"] == post
    assert act()["total"] == 2 * 16384 * 32 + post + logits
    # Full recompute adds one block's full activations being recomputed.
    assert act(recompute="full")["total"] == 2 * 2 * 16384 + 16384 * 32 + post + logits
    # 1F1B: the first of 2 stages holds 2 micro-batches of its 1 layer; interleaved x (1 + 1/4).
    assert act(pp=2, dp=1)["first"] == 1 * 16384 * 32 * 2
    toy4 = ModelConfig(family="gpt", num_layers=4, hidden_size=64, num_attention_heads=8,
                       vocab_size=300, max_position_embeddings=128)
    inter = activation_bytes(plan_args(toy4, seq_length=128, micro_batch_size=2, pp=2, vpp=2))
    assert inter["first"] == pytest.approx(2 * 16384 * 32 * 2 * 1.25)


def test_activation_terms_of_llama_and_bloom():
    """RoPE adds the rotated q, k; SwiGLU keeps gate, up and its output; ALiBi (FlexAttention)
    an extra copy of the attention output; BLOOM the embedding LayerNorm's input."""
    llama = ModelConfig(family="llama", num_layers=1, hidden_size=64, num_attention_heads=8,
                        num_key_value_heads=2, ffn_hidden_size=192, vocab_size=300,
                        max_position_embeddings=128)
    parts = block_coefficients(llama, 1, 1, False, "none")
    # kv = 2 heads x 8 = 16: qkv 2 (64 + 32) / 64 = 3, rope 2 (64 + 16) / 64 = 2.5, MLP 6 x 3.
    assert parts == dict(norm_inputs=4, matmul_inputs=4, qkv=3, rope=2.5, dense_input=2,
                         dense_copy=0, mlp=18)
    assert block_coefficients(llama, 1, 1, False, "selective")["rope"] == 0
    bloom = ModelConfig(family="bloom", num_layers=1, hidden_size=64, num_attention_heads=8,
                        vocab_size=300, max_position_embeddings=128)
    assert sum(block_coefficients(bloom, 1, 1, False, "none").values()) == 34
    est = activation_bytes(plan_args(bloom, seq_length=128, micro_batch_size=2))
    assert est["post"] == 16384 * (4 + 2)


def test_mixed_precision_and_zero_bytes():
    n = count_parameters(TOY)
    # megazoo's engine: fp32 runs keep parameters = masters (4 B) + moments (8 B), fp32 main
    # gradients (4 B); bf16 adds fp32 masters (2 + 4 + 12 B); the distributed optimizer
    # shards masters and moments over dp x sp. Its buckets are views: no extra buffer.
    plain = estimate_memory(plan_args(seq_length=128, bf16=False))
    assert (plain.parameters, plain.gradients, plain.optimizer_states) == (4 * n, 4 * n, 8 * n)
    assert plain.communication_buffers == RUNTIME_BYTES
    bf16 = plan_args(seq_length=128, dp=2, sp=2)
    est = estimate_memory(bf16)
    assert (est.parameters, est.gradients, est.optimizer_states) == (2 * n, 4 * n, 12 * n)
    bf16.training = dataclasses.replace(bf16.training, use_distributed_optimizer=True)
    assert estimate_memory(bf16).optimizer_states == 12 * n / 4
    z1 = estimate_memory(plan_args(seq_length=128, dp=4, zero_stage=1))
    assert z1.optimizer_states == 12 * n / 4 and z1.gradients == 2 * n
    z2 = estimate_memory(plan_args(seq_length=128, dp=2, sp=2, zero_stage=2),
                         PlanOptions(fp32_grad_accumulation=True))
    assert z2.gradients == 4 * n / 4  # ZeRO partitions over dp * sp
    off = estimate_memory(plan_args(seq_length=128, dp=4, zero_stage=2, offload_optimizer="cpu"))
    assert off.optimizer_states == 0 and off.host_per_gpu == 16 * n / 4
    assert off.host_per_node == 4 * off.host_per_gpu
    subtotal = sum(getattr(plain, k) for k in ("parameters", "gradients", "optimizer_states",
                                               "activations", "communication_buffers"))
    assert plain.fragmentation == pytest.approx(0.1 * subtotal)
    assert plain.gpu_total == pytest.approx(1.1 * subtotal)
    # What max_memory_allocated is compared with: no allowance, no CUDA context.
    assert plain.allocated == pytest.approx(subtotal - RUNTIME_BYTES)


def test_zero3_working_set():
    n = count_parameters(TOY)
    kw = dict(seq_length=128, dp=8, zero_stage=3)
    fsdp = estimate_memory(plan_args(**kw, zero_impl="fsdp2", fsdp_blocks_per_unit=1))
    # Units: 2 blocks of 49,984 and the embedding (384 + 128 positions) x 64 = 32,768; the head
    # is tied. FSDP2 gathers the two largest (blocks: one computing, one prefetched) beside its
    # fp32 shards (4 B / Z), and holds one unit's bf16 gradient beside fp32 gradient shards.
    assert fsdp.parameters == 4 * n / 8 + 2 * (BLOCK + BLOCK)
    assert fsdp.gradients == 4 * n / 8 + 2 * BLOCK
    big_vocab = ModelConfig(family="gpt", num_layers=2, hidden_size=64, num_attention_heads=8,
                            vocab_size=5000, max_position_embeddings=128)  # padded 5,120
    est = estimate_memory(plan_args(big_vocab, **kw, zero_impl="fsdp2", fsdp_blocks_per_unit=1))
    emb = 5120 * 64 + 128 * 64
    assert est.parameters == 4 * count_parameters(big_vocab) / 8 + 2 * (emb + BLOCK)
    # DeepSpeed keeps gathered what it reuses within 1e9 elements: this whole small model. Its
    # ZeRO-3 also keeps the fp32 gradient buffer of its largest sub-group (here all n / 8) on
    # the GPU (the +12% the Ulysses sp = 2 run measured above the plan without it,
    # bench/README.md).
    ds = estimate_memory(plan_args(**kw))
    assert ds.parameters == 2 * n / 8 + 2 * n
    assert ds.gradients == 2 * n / 8 + 2 * BLOCK + 4 * n / 8


def test_bloom_176b_claim_is_false():
    """'BLOOM-176B on 8x A100-80GB with ZeRO-3 + CPU optimizer offload in < 24 GB/GPU'."""
    layout = plan_args(PRESETS["bloom-176b"], dp=8, zero_stage=3, offload_optimizer="cpu",
                       recompute="full", micro_batch_size=1, seq_length=2048)
    est = estimate_memory(layout, PlanOptions(gpu_memory=80))
    assert est.num_parameters == 176_247_271_424
    assert est.parameters >= 176_247_271_424 * 2 / 8  # bf16 shards stay on the GPU: 44 GB
    assert est.gpu_total > 24 * GB and not est.fits
    # 2.1 TB of masters, m and v on the node, 3.4 TB in all: DeepSpeed's fp32 gradients (4 B)
    # and flat bf16 gradient partitions (2 B) are pinned, so rounded up to powers of two,
    # at most doubled (megazoo/plan/deepspeed_host.py)
    per_gpu = 176_247_271_424 / 8
    assert 8 * 18 * per_gpu < est.host_per_node < 8 * 24 * per_gpu


def test_fsdp2_offload_moves_parameters_and_has_no_buckets():
    """FSDP2's CPUOffloadPolicy: 16 B per parameter on the host (fp32 params, grads, m, v) and
    only the ZeRO-3 working set on the GPU; DeepSpeed keeps the bf16 shards and its buckets."""
    n = count_parameters(TOY)
    kw = dict(seq_length=128, dp=4, zero_stage=3, offload_optimizer="cpu")
    ds = estimate_memory(plan_args(**kw))
    fsdp = estimate_memory(plan_args(**kw, zero_impl="fsdp2", fsdp_blocks_per_unit=1))
    assert fsdp.parameters == 2 * (BLOCK + BLOCK) and ds.parameters == 2 * n / 4 + 2 * n
    assert fsdp.optimizer_states == 0 and fsdp.gradients == 2 * BLOCK
    assert fsdp.communication_buffers == RUNTIME_BYTES < ds.communication_buffers
    # parameters and gradients pinned, each tensor's shard rounded up to a power of two
    shards = sum(pinned(4 * -(-p.numel() // 4)) for p in build_model(TOY).parameters())
    assert fsdp.host_per_gpu == pytest.approx(2 * shards + 8 * n / 4 + TORCH_HOST_RUNTIME_BYTES)
    assert 2 * shards > 8 * n / 4  # the rounding shows at this size


def test_fsdp2_without_reshard_keeps_every_unit_gathered():
    """--no-fsdp-reshard-after-forward: the whole stage's bf16 parameters instead of 2 units."""
    n = count_parameters(TOY)
    kw = dict(seq_length=128, dp=4, zero_stage=3, offload_optimizer="cpu", zero_impl="fsdp2",
              fsdp_blocks_per_unit=1)
    keep = estimate_memory(plan_args(**kw, fsdp_reshard_after_forward=False))
    reshard = estimate_memory(plan_args(**kw))
    assert keep.parameters == 2 * n and reshard.parameters == 2 * (BLOCK + BLOCK)
    assert keep.gradients == reshard.gradients and keep.host_per_gpu == reshard.host_per_gpu


def test_fsdp2_units_of_blocks_gather_a_unit_at_a_time():
    """--fsdp-blocks-per-unit: the working set holds the two largest gathered units. TOY's 2
    blocks make 2 units of one block, or 1 unit of both beside the embedding's (the head is
    tied); a unit never spans pipeline stages: at pp 2 each rank's unit is its one block,
    gathered beside the embedding (the head, untied there, is smaller)."""
    kw = dict(seq_length=128, dp=4, zero_stage=3, offload_optimizer="cpu", zero_impl="fsdp2")
    one, two = (estimate_memory(plan_args(**kw, fsdp_blocks_per_unit=n)) for n in (1, 2))
    embedding = (384 + 128) * 64
    assert one.parameters == 2 * (BLOCK + BLOCK)
    assert two.parameters == 2 * (2 * BLOCK + embedding)
    stages = estimate_memory(plan_args(**kw, pp=2, fsdp_blocks_per_unit=2))
    assert stages.parameters == 2 * (BLOCK + embedding)


def test_gpt_1_3b_fsdp2_plan_matches_the_h100_runs():
    """zero_bench on one H100 (bench/README.md): 17.4 GB allocated resharding, 19.8 GB keeping
    the gathered parameters; the planner within 2% of both."""
    kw = dict(micro_batch_size=4, seq_length=2048, zero_stage=3, offload_optimizer="cpu",
              zero_impl="fsdp2")
    for reshard, measured in ((True, 17.4), (False, 19.8)):
        est = estimate_memory(plan_args(PRESETS["gpt-1.3b"], **kw,
                                        fsdp_reshard_after_forward=reshard))
        assert est.allocated / GB == pytest.approx(measured, rel=0.02), reshard


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_block_coefficients_match_what_a_gpt_block_saves(recompute):
    """The planner's per-block count against the bytes a real GPT block saves for backward
    (saved-tensor hooks, distinct storages, parameters excluded), bf16 on CPU. SDPA on CPU
    keeps what the GPU kernels keep (q, k, v, output, log-sum-exp). Tolerance 1 %: the
    fp32 log-sum-exp [b, a, s] and the norms' fp32 mean / rstd [s, b] are not in the count
    (0.09 of 32 here)."""
    import torch

    from megazoo.models import build_model

    cfg = ModelConfig(family="gpt", num_layers=1, hidden_size=256, num_attention_heads=4,
                      vocab_size=1000, max_position_embeddings=128, recompute=recompute)
    model = build_model(cfg, None, device="cpu", dtype=torch.bfloat16, seed=0)
    x = model.embedding(torch.randint(0, 1000, (2, 128)), 0).detach().requires_grad_()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["0"](x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(n for ptr, n in storages.items() if ptr not in params)
    layout = plan_args(cfg, seq_length=128, micro_batch_size=2, recompute=recompute)
    assert saved == pytest.approx(activation_bytes(layout)["block"], rel=0.01)


@pytest.mark.parametrize("flags, measured_gb", [
    (["--model", "gpt-1.3b", "--seq-length", "2048", "--micro-batch-size", "4"], 35.27),
    (["--family", "llama", "--num-layers", "4", "--hidden-size", "4096",
      "--num-attention-heads", "32", "--num-key-value-heads", "8", "--ffn-hidden-size", "14336",
      "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1"],
     18.92)])
def test_megazoo_engine_matches_h100_runs(flags, measured_gb):
    """pretrain_gpt.py --bf16 on one H100 (bench/README.md, train_bench.py, vocabulary 2048):
    the peak allocated memory it logged against the plan of the same flags, within 5%."""
    from megazoo.config.flags import parse_args

    args = parse_args(flags + ["--bf16", "--global-batch-size", "8"])
    args.model = dataclasses.replace(args.model, vocab_size=2048)
    assert estimate_memory(args).allocated / 1e9 == pytest.approx(measured_gb, rel=0.05)
