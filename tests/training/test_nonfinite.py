"""Steps skipped for non-finite values: the lr clock of every engine, the stop after
--max-skipped-steps in a row, and no checkpoint from non-finite weights."""
import math

import pytest
import torch

from megazoo.parallel import ParallelConfig
from megazoo.testing import run_distributed
from megazoo.training.run import main

from helpers import zero_checks as ranks
from helpers.runs import tiny_argv

SKIP_AT = (1, 3, 4)  # steps whose loss is forced to nan
STEPS = 7


class _PoisonFinalNorm:
    """Forward hook on the final norm: its output times nan while `on` (nan loss and grads)."""

    def __init__(self, model):
        self.on = False
        model.final_norm.register_forward_hook(self)

    def __call__(self, module, args, out):
        return out * math.nan if self.on else None


def _lrs(engine, state) -> list[tuple[float, bool]]:
    poison = _PoisonFinalNorm(engine.model)
    out = []
    for step in range(STEPS):
        poison.on = step in SKIP_AT
        r = engine.train_step(ranks.batches(step, state))
        out.append((r.lr, r.skipped))
    return out


def _three_engines() -> dict:
    from megazoo.models import build_model
    from megazoo.training.backends.plain import PlainEngine

    par = ParallelConfig()
    state = ranks.state_for(par)
    args = ranks.make_args(par, state.dp.size)
    plain = PlainEngine(build_model(args.model, state, device="cpu", seed=7), state, args)
    fsdp, state, _ = ranks.fsdp_engine(par, num_layers=2)
    ds, state = ranks.deepspeed_engine(par, zero_stage=1)
    return {"plain": _lrs(plain, state), "fsdp2": _lrs(fsdp, state), "deepspeed": _lrs(ds, state)}


def test_skipped_steps_do_not_advance_the_lr_clock_in_any_engine():
    """Forced nan losses at steps 1, 3, 4: every engine skips them (DeepSpeed by its own
    overflow counter) and uses the learning rate of the steps applied so far."""
    from megazoo.training.lr_schedule import learning_rate

    out = run_distributed(_three_engines, 1, timeout=300)[0]
    cfg = ranks.make_args(ParallelConfig(), 1).training
    want, clock = [], 0
    for step in range(STEPS):
        want.append((learning_rate(clock, cfg), step in SKIP_AT))
        clock += step not in SKIP_AT
    want_lrs, want_skipped = zip(*want)
    for name, got in out.items():
        lrs, skipped = zip(*got)
        assert skipped == want_skipped, name
        assert list(lrs) == pytest.approx(list(want_lrs)), name


def test_fp16_lr_10_stops_with_one_error_line(data, capsys):
    rc = main(tiny_argv(data, "--fp16", "--lr", "10", "--min-lr", "1", "--train-iters", "30",
                        "--max-skipped-steps", "5", "--micro-batch-size", "1"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("error: iteration ") and "5 steps in a row skipped" in err[0]
    assert "--lr" in err[0]


def test_checkpoint_with_inf_weight_stops_and_latest_stays(data, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    save = tmp_path / "ck"
    assert main(tiny_argv(data, "--save", str(save), "--exit-interval", "3")) == 0
    file = next((save / "iter_0000003").glob("*.safetensors"))
    tensors = load_file(str(file))
    key = next(k for k in tensors if k.endswith("final_norm.weight") and "/" not in k)
    tensors[key][0] = math.inf
    save_file(tensors, str(file))
    capsys.readouterr()
    # Loading refuses it twice over: the checksum, then (unverified) the inf itself.
    assert main(tiny_argv(data, "--save", str(save), "--load", str(save))) == 2
    assert "is corrupted" in capsys.readouterr().err
    unchecked = ["--no-verify-checksums"]
    assert main(tiny_argv(data, "--save", str(save), "--load", str(save), *unchecked)) == 2
    assert "non-finite value" in capsys.readouterr().err
    # Forced through, training skips every step (nan losses) and never saves: the run stops
    # at the save (exit 1) naming the iteration, the non-finite loss and the likely cause.
    forced = unchecked + ["--allow-nonfinite-load"]
    rc = main(tiny_argv(data, "--save", str(save), "--load", str(save), *forced))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("error: iteration 6: not saving a checkpoint, the training loss nan")
    assert "latest still names iteration 3; likely cause: the checkpoint loaded from" in err[0]
    assert (save / "latest").read_text().strip() == "3"
    assert not (save / "iter_0000006").exists()
    rc = main(tiny_argv(data, "--save", str(save), "--load", str(save), "--train-iters", "20",
                        "--max-skipped-steps", "4", *forced))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and "iteration 7: 4 steps in a row" in err[0] and "checkpoint" in err[0], err


def _deepspeed_save_with_inf(root: str, stage: int) -> str:
    """ZeRO `stage` on 2 dp ranks, an inf in rank 1's part of one weight: the engine's save."""
    import os

    from megazoo.checkpoint.files import NonFiniteError

    engine, state = ranks.deepspeed_engine(ParallelConfig(), zero_stage=stage)
    name, p = next((n, p) for n, p in engine.model.named_parameters() if n.endswith("fc1.weight"))
    if state.dp.rank == 1:
        with torch.no_grad():
            getattr(p, "ds_tensor", p).view(-1)[0] = math.inf
    path = os.path.join(root, f"z{stage}")
    try:
        engine.save(path, {})
    except NonFiniteError as exc:
        return f"{exc} | written: {os.path.exists(path)}"
    return f"saved {name}"


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_save_refuses_nonfinite_weights_on_every_rank(tmp_path, stage):
    """The DeepSpeed engine writes its own format, so its save makes the check itself
    (ZeRO-3: on each rank's partition) with the same agreement and wording as the others'."""
    rank0, rank1 = run_distributed(_deepspeed_save_with_inf, 2, str(tmp_path), stage,
                                   timeout=300)
    assert "another rank found a tensor holding inf or nan" in rank0 and "written: False" in rank0
    assert "fc1.weight' holds 1 non-finite value (inf or nan)" in rank1, rank1
    assert rank1.endswith("written: False")
