"""Steps skipped for non-finite values: counted, logged, and a stop with a clear reason.

    watch = SkipWatch(args, resumed_from, log)
    watch.after_step(iteration, result)      # raises TrainingStopped after too many in a row
    try:
        save_training_checkpoint(engine, ...)
    except NonFiniteError as exc:            # every engine's save refuses inf / nan
        raise stopped_by_nonfinite_save(exc, iteration, watch, result)

Every engine skips a step whose loss or gradient norm is inf / nan (fp16 overflow is one
case) without advancing its learning-rate clock. A skip is logged with the running counts;
`--max-skipped-steps` consecutive ones stop the run with one line naming the iteration and
the likely cause. Every engine's save refuses non-finite weights or optimizer state, so
`latest` keeps naming the last good checkpoint and the run stops the same way, exit status 1.
"""
from __future__ import annotations

import math

from ..checkpoint.files import NonFiniteError
from .backends.base import StepResult, TrainingStopped
from .checkpoint import where_latest_is


class SkipWatch:
    """Counts skipped steps (in a row and in all) and stops the run after too many."""

    def __init__(self, args, resumed_from: int, log):
        self.args, self.resumed_from, self.log = args, resumed_from, log
        self.in_a_row = self.total = 0
        self.first_of_streak: int | None = None

    def after_step(self, iteration: int, result: StepResult) -> None:
        """`iteration`: 1-based number of the step just taken."""
        if not result.skipped and math.isfinite(result.loss):
            self.in_a_row, self.first_of_streak = 0, None
            return
        self.in_a_row += 1
        self.total += 1
        if self.first_of_streak is None:
            self.first_of_streak = iteration
        self.log(f"iteration {iteration}: step skipped (loss {result.loss:.4g}, grad norm "
                 f"{result.grad_norm:.4g}); {self.in_a_row} in a row, {self.total} in all")
        limit = self.args.training.max_skipped_steps
        if limit and self.in_a_row >= limit:
            raise TrainingStopped(
                f"iteration {iteration}: {self.in_a_row} steps in a row skipped for a non-finite "
                f"loss or gradient norm (--max-skipped-steps {limit}); likely cause: "
                f"{self.cause(result)}")

    def cause(self, result: StepResult) -> str:
        t, load = self.args.training, self.args.checkpoint.load
        if load and self.first_of_streak == self.resumed_from + 1:
            return (f"the checkpoint loaded from {load} holds non-finite weights or optimizer "
                    "state: resume from an earlier checkpoint")
        if t.fp16 and result.loss_scale is not None and result.loss_scale <= t.min_loss_scale:
            return (f"the fp16 loss scale is at its minimum ({result.loss_scale:g}) and the "
                    f"gradients still overflow: lower --lr (now {t.lr:g}) or use --bf16")
        return f"the learning rate is too high (--lr {t.lr:g}): lower it or lengthen the warmup"


def refuse_nonfinite_loss(iteration: int, result: StepResult, valid: float | None,
                          watch: SkipWatch, save_dir: str) -> None:
    """TrainingStopped (exit 1) instead of saving iteration `iteration` when its training
    loss or the last evaluation loss is inf / nan: finite weights can still be unusable
    (a blow-up near the end of a run), and `latest` must keep naming weights that work.
    Every rank decides alike (both losses are the same on every rank)."""
    bad = [f"{what} {value:g}" for what, value in (("training loss", result.loss),
                                                   ("last evaluation loss", valid))
           if value is not None and not math.isfinite(value)]
    if not bad:
        return
    raise TrainingStopped(f"iteration {iteration}: not saving a checkpoint, the "
                          f"{' and the '.join(bad)}; {where_latest_is(save_dir)}; likely cause: "
                          f"{watch.cause(result)}")


def stopped_by_nonfinite_save(exc: NonFiniteError, iteration: int, watch: SkipWatch,
                              result: StepResult) -> TrainingStopped:
    """The run's one error for a save refused for inf / nan (the same on every rank): the
    iteration, the tensor and checkpoint (in `exc`) and the likely cause."""
    return TrainingStopped(f"iteration {iteration}: {exc}; likely cause: {watch.cause(result)}")
