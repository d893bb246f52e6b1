"""Compressed gradient communication in the plain engine and pretrain_gpt.py, on gloo.

Exactness. topk at ratio 1 sends every entry and each rank adds the two ranks' buckets
(a + b, the same float32 sum a 2-rank all-reduce makes), so dp=2 training is bit for bit the
uncompressed run. At dp=1 nothing is reduced, so compression changes nothing. A resumed
compressed run repeats the uninterrupted one bit for bit only if the residuals are restored.
"""
import json

import pytest
import torch

from megazoo.testing import run_distributed
from megazoo.training.run import run_training

from helpers import compression_checks as checks
from helpers.runs import tiny_argv

TIMEOUT = 240
BUCKETS = {"ddp_bucket_size": 3000, "overlap_grad_reduce": True}


def _pairs(jobs):
    return [(checks.train_steps({}, training, 3), checks.train_steps(comp, training, 3))
            for comp, training in jobs]


def test_topk_ratio_one_is_the_uncompressed_run_and_dp1_is_untouched():
    jobs = [({"gradient_compression": "topk", "topk_ratio": 1.0}, BUCKETS),
            ({"gradient_compression": "topk", "topk_ratio": 1.0},
             {**BUCKETS, "use_distributed_optimizer": True})]
    for rank_out in run_distributed(_pairs, 2, jobs, timeout=TIMEOUT):
        for plain, topk in rank_out:
            assert plain["losses"] == topk["losses"]
            assert all(torch.equal(a, b) for a, b in zip(plain["params"], topk["params"]))
            assert topk["stats"]["compression_ratio"] < 1  # ratio 1 sends more, not less
    plain, one = _pairs([({"gradient_compression": "1bit"}, BUCKETS)])[0]
    assert plain["losses"] == one["losses"] and one["stats"] == {}


def _stop_and_resume(argv, save, log):
    full = run_training(argv)["losses"]
    lines = []
    first = run_training([*argv, "--save", save, "--exit-interval", "2", "--log-json", log],
                         print_fn=lines.append)["losses"]
    rest = run_training([*argv, "--save", save, "--load", save])["losses"]
    return full, first, rest, lines


TOPK_TUNED = ["--compression-recipe", "topk-tuned", "--gradient-compression", "topk",
              "--clip-grad", "0.05"]


@pytest.mark.parametrize("frozen", [[], ["--freeze-variance"], TOPK_TUNED],
                         ids=["gradients", "1-bit-adam", "topk-tuned"])
def test_resume_is_exact_with_residuals_and_dp_change_drops_them(data, tmp_path, frozen):
    """dp=2, 1bit from step 1 on (worker and server residuals; with --freeze-variance the
    momentum compressed and v frozen and floored; the last case the topk-tuned recipe from
    step 1 instead: 30% of the momentum compressed, entries chosen by the frozen variance and
    each rank's gradient clipped, a clip small enough to act): stop at 2 and resume to 4 bit for bit; the text and JSON logs carry bytes and
    ratio; resuming at dp=1 drops the residuals with a warning."""
    argv = tiny_argv(data, "--train-iters", "4", "--gradient-compression", "1bit",
                     "--compression-start-step", "1", *frozen)
    save, log = str(tmp_path / "ck"), str(tmp_path / "log.jsonl")
    full, first, rest, lines = run_distributed(_stop_and_resume, 2, argv, save, log,
                                               timeout=TIMEOUT)[0]
    assert first + rest == full
    text = "\n".join(lines)
    assert "comm_bytes" in text and "compression_ratio" in text
    records = [json.loads(line) for line in open(log)]
    ratios = [r["compression_ratio"] for r in records if "compression_ratio" in r]
    assert ratios[0] == 1.0 and ratios[1] > 10  # step 0 dense (warmup), step 1 compressed
    lines = []
    run_training([*argv, "--load", save, "--save", ""], print_fn=lines.append)
    assert any("residuals were saved with dp 2 (this run 1): dropping them" in line
               for line in lines), lines


def _norm_jobs(jobs):
    return [checks.step_norms(comp, training, 3) for comp, training in jobs]


def test_local_clipping_bounds_each_ranks_gradient():
    """Local clipping (a recipe internal), lossless topk (ratio 1, no momentum offset): the reduced
    gradient is the mean of the ranks' gradients, each clipped to clip_grad x sqrt(dp) first,
    so its norm is at most that (the optimizer does not clip it again); without it the
    reported norm is the unclipped one, far above. Compression from step 1: step 0 (dense)
    is the same in both."""
    comp = {"gradient_compression": "topk", "topk_ratio": 1.0, "compression_start_step": 1}
    training = {**BUCKETS, "clip_grad": 0.01}
    jobs = [({**comp, "local_clipping": True}, training), (comp, training)]
    for clipped, plain in run_distributed(_norm_jobs, 2, jobs, timeout=TIMEOUT):
        assert clipped[0] == plain[0] > 0.1
        assert all(n <= 0.01 * 2 ** 0.5 * (1 + 1e-5) for n in clipped[1:]), clipped
        assert all(n > 0.1 for n in plain[1:]), plain


def _momentum_jobs(jobs):
    return [checks.with_and_without_momentum(comp, training, 4) for comp, training in jobs]


def test_momentum_compression_cancels_and_changes_what_is_compressed():
    """With --freeze-variance each rank compresses its local momentum (1-bit Adam): the
    offset added before the reduction is taken off after it. Lossless (topk ratio 1) the run
    equals the one without the offset up to the rounding of adding and removing
    beta1 / (1 - beta1) m: losses to rtol 1e-5, parameters to atol 1e-5 (adam_eps 1e-3 here:
    the frozen step divides by sqrt(v) + eps, and with 1e-8 coordinates whose v froze at zero,
    embedding rows of tokens the first step did not see, would magnify that rounding 1e8-fold;
    an offset that does not cancel moves parameters by ~lr = 1e-2); lossy (1bit) the offset
    changes what the codec sees,
    so the parameters differ, and every rank still holds the same ones. With the distributed
    optimizer (one momentum shard per rank) it compresses gradients, as without the flag.
    The momentum share (a recipe internal): half the momentum carried cancels the same way and gives a
    third set of parameters under 1bit; a share of 0 adds 0 x m, the run without the offset
    bit for bit."""
    frozen = {"compression_start_step": 1, "freeze_variance": True}
    half, none = ({**frozen, "momentum_share": c} for c in (0.5, 0.0))
    eps = {**BUCKETS, "adam_eps": 1e-3}
    jobs = [({"gradient_compression": "topk", "topk_ratio": 1.0, **frozen}, eps),
            ({"gradient_compression": "1bit", **frozen}, BUCKETS),
            ({"gradient_compression": "1bit", **frozen}, {**BUCKETS, "use_distributed_optimizer": True}),
            ({"gradient_compression": "topk", "topk_ratio": 1.0, **half}, eps),
            ({"gradient_compression": "1bit", **half}, BUCKETS),
            ({"gradient_compression": "1bit", **none}, BUCKETS)]
    ranks = run_distributed(_momentum_jobs, 2, jobs, timeout=TIMEOUT)
    (lossless, lossy, sharded, lossless_half, lossy_half, lossy_none), (_, lossy1, *_) = ranks
    for carried, plain in (lossless, lossless_half):
        torch.testing.assert_close(carried["losses"], plain["losses"], rtol=1e-5, atol=0)
        for a, b in zip(carried["params"], plain["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    def differ(x, y):
        return any(not torch.allclose(a, b, rtol=1e-4, atol=0) for a, b in zip(x["params"], y["params"]))

    carried, plain = lossy
    assert differ(carried, plain)
    assert differ(lossy_half[0], carried) and differ(lossy_half[0], plain)
    assert all(torch.equal(a, b) for a, b in zip(lossy_none[0]["params"], lossy_none[1]["params"]))
    assert all(torch.equal(a, b) for a, b in zip(carried["params"], lossy1[0]["params"]))
    assert all(torch.equal(a, b) for a, b in zip(sharded[0]["params"], sharded[1]["params"]))


def test_frozen_variance_step_is_adamw_when_v_would_not_move():
    """With v = g^2 already, AdamW's own update leaves v unchanged, so the frozen step (v
    frozen at that step count) must give the same parameters as the fused kernel (rtol 1e-6:
    the same formula, other kernels)."""
    from megazoo.compress.frozen_adam import frozen_variance_step

    gen = torch.Generator().manual_seed(0)
    results = []
    for frozen in (False, True):
        p = torch.randn(50, generator=torch.Generator().manual_seed(1))
        p.grad = torch.randn(50, generator=gen.manual_seed(2))
        opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        opt.state[p] = {"step": torch.tensor(4.0), "exp_avg": torch.randn(50, generator=gen),
                        "exp_avg_sq": (p.grad / 2).square()}  # the gradient divisor is 2
        opt.grad_scale = torch.tensor(2.0)
        if frozen:
            frozen_variance_step(opt, 0.1, 2.0, frozen_at=5)
        else:
            opt.step()
        results.append((p.detach().clone(), opt.state[p]["exp_avg"].clone(),
                        float(opt.state[p]["step"])))
    (a, ma, sa), (b, mb, sb) = results
    assert sa == sb == 5.0
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(mb, ma, rtol=1e-6, atol=1e-7)


def test_residual_files_are_verified_on_read(tmp_path):
    """Residuals written with their checksums read back bit for bit; one flipped byte in the
    data region is a ValueError naming the tensor."""
    from megazoo.compress import state as compression_state

    errors = {"bucket0.worker": torch.randn(1000), "bucket0.server": torch.randn(250)}
    compression_state.write_errors(errors, str(tmp_path), rank=0)
    here = {"algorithm": "BlockReduction", "dp": 2}
    back, note = compression_state.read_errors(str(tmp_path), here, here, 0, torch.device("cpu"))
    assert note is None and set(back) == set(errors)
    assert all(torch.equal(back[k], errors[k]) for k in errors)
    file = tmp_path / "compression" / "rank00000.safetensors"
    raw = bytearray(file.read_bytes())
    raw[-3] ^= 0x40  # inside the last tensor's data
    file.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="is corrupted: tensor .* does not match its checksum"):
        compression_state.read_errors(str(tmp_path), here, here, 0, torch.device("cpu"))


def test_residuals_are_checked_for_nan_and_missing_checksums(tmp_path):
    """A nan under a matching checksum, or a checksum note without values, is an error (the
    bytes verifying does not make them usable; an edited note does not switch the check
    off); the run's --allow-nonfinite-load / --no-verify-checksums let them through."""
    import json

    from safetensors.torch import save_file

    from megazoo.checkpoint.checksums import digest
    from megazoo.checkpoint.files import tensor_bytes
    from megazoo.compress import state as compression_state

    errors = {"bucket0.worker": torch.randn(100)}
    errors["bucket0.worker"][7] = float("nan")
    folder, here, cpu = str(tmp_path), {"algorithm": "BlockReduction"}, torch.device("cpu")
    file = tmp_path / "compression" / "rank00000.safetensors"
    file.parent.mkdir()
    save_file(errors, str(file))  # megazoo's writer refuses the nan: written as a flipped bit would
    note = {"checksum": "crc32", "values": {
        "bucket0.worker": digest(tensor_bytes(errors["bucket0.worker"]), "crc32")}}
    (tmp_path / "compression" / "rank00000.safetensors.checksums.json").write_text(json.dumps(note))
    with pytest.raises(ValueError, match="'bucket0.worker' holds 1 non-finite value"):
        compression_state.read_errors(folder, here, here, 0, cpu)
    back, _ = compression_state.read_errors(folder, here, here, 0, cpu, allow_nonfinite=True)
    assert torch.isnan(back["bucket0.worker"][7])
    del note["values"]
    (tmp_path / "compression" / "rank00000.safetensors.checksums.json").write_text(json.dumps(note))
    with pytest.raises(ValueError, match="cannot be read .*--no-verify-checksums"):
        compression_state.read_errors(folder, here, here, 0, cpu, allow_nonfinite=True)
    compression_state.read_errors(folder, here, here, 0, cpu, verify_checksums=False,
                                  allow_nonfinite=True)
