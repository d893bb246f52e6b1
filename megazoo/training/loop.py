"""The training loop: steps, progress bar, logs, evaluation, checkpoints, final sample.

    out = train(run)       # run: megazoo.training.run.Run (what setup built)

It reports metrics (the log line, `--log-json`, TensorBoard / W&B, `run.logger.records`);
pictures are the caller's (`megazoo.plot.draw_run_curves`).
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

from ..generation.api import generate
from ..models.flops import flops_per_iteration
from .checkpoint import save_training_checkpoint
from .data import tokens_per_step
from ..checkpoint.files import NonFiniteError
from ..errors import user_path
from .metrics import speed_note
from .nonfinite import SkipWatch, refuse_nonfinite_loss, stopped_by_nonfinite_save
from .run_checks import saved_iterations
from .signals import StopSignals, TrainingInterrupted, interrupted_message

SUMMARY_STEPS = 10  # the final train loss averages this many last iterations


class _Progress:
    """A tqdm bar on rank 0 (if enabled and installed, and only on a terminal: redirected to
    a file, its redraws would be carriage-return noise, so a log gets the log lines only);
    log lines go through it."""

    def __init__(self, run):
        self.bar = None
        cfg = run.args
        if run.state.global_rank == 0 and cfg.logging.progress and _on_terminal():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=cfg.training.train_iters, initial=run.start_iteration,
                                unit="it", dynamic_ncols=True)
                run.logger.print = self.bar.write
            except ImportError:
                pass

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _on_terminal() -> bool:
    """Whether the bar (stderr) and the log lines (stdout) both go to a terminal."""
    return all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


def seed_step(seed: int, iteration: int, state) -> None:
    """Seed torch's generators for step `iteration` (0-based) from (--seed, pipeline stage,
    iteration) alone: dropout masks then depend on nothing that ran before in the process, and
    a run resumed at iteration N draws on every rank what the uninterrupted run drew (a
    checkpoint's RNG state is rank 0's, which another stage or tp rank did not have). Stages
    get their own streams (Megatron's seed + 100 x pp rank); the tp, sp and dp ranks of a stage
    share one, so activations replicated over tp get identical masks."""
    torch.manual_seed(((seed + 100 * state.pp.rank) * 1_000_003 + iteration) % 2 ** 63)


def _save(run, iteration: int, watch: SkipWatch, result, valid: float | None) -> str:
    """Save iteration `iteration`; a save refused for inf / nan stops the run (exit 1), and
    so does a non-finite last training or evaluation loss (`nonfinite.refuse_nonfinite_loss`):
    weights that give such a loss are not saved, and `latest` stays where it was."""
    save_dir = run.args.checkpoint.save
    refuse_nonfinite_loss(iteration, result, valid, watch, save_dir)
    extra = {"consumed_samples": iteration * run.args.training.global_batch_size,
             "args": run.args.to_dict()}
    try:
        with user_path("--save", save_dir):  # a full disk: one line, `latest` unmoved
            path = save_training_checkpoint(run.engine, save_dir, iteration, extra, run.state,
                                            overwrite=run.args.checkpoint.overwrite_checkpoints,
                                            resumed_from=run.start_iteration)
    except NonFiniteError as exc:
        raise stopped_by_nonfinite_save(exc, iteration, watch, result) from None
    run.logger.print(f"saved checkpoint {path}")
    return path


def _log_record(run, iteration, result, seconds, steps, skipped_total) -> dict:
    a, t = run.args, run.args.training
    flops = steps * flops_per_iteration(t.global_batch_size, a.data.seq_length,
                                        a.model.num_layers, a.model.hidden_size,
                                        a.model.padded_vocab(1))
    record = {"iteration": iteration, "loss": result.loss, "lr": result.lr,
              "grad_norm": result.grad_norm}
    if result.loss_scale is not None:
        record["loss_scale"] = result.loss_scale
    if result.skipped:
        record["skipped"] = True
    record["skipped_steps"] = skipped_total
    record.update(getattr(run.engine, "comm_stats", dict)())
    record.update(run.logger.throughput(flops, seconds, run.state.world_size,
                                        steps * tokens_per_step(a)))
    record.update(run.logger.memory())
    return record


def evaluate(run: Run) -> float | None:
    """Mean validation loss over --eval-iters global batches (None without valid data)."""
    iters = run.args.logging.eval_iters
    if run.data.valid is None or iters == 0:
        return None
    losses = [run.engine.eval_loss(run.data.valid_batch(i, run.state)) for i in range(iters)]
    return sum(losses) / len(losses)


def _header(run) -> None:
    """The run's first lines, and the --log-json record the curves' token axis comes from."""
    a = run.args
    run.logger.print(f"{run.state} | model {a.model.family} L{a.model.num_layers} "
                     f"h{a.model.hidden_size} vocab {a.model.vocab_size} | "
                     f"unigram entropy of the data {run.entropy:.3f} nats/token")
    run.logger.print(f"each logged loss is that one iteration's mean over its "
                     f"{a.training.global_batch_size} x {a.data.seq_length} tokens; the final "
                     f"train loss averages the last {SUMMARY_STEPS} iterations' losses")
    run.logger.write({"tokens_per_step": tokens_per_step(a), "start_iteration": run.start_iteration,
                      "global_batch_size": a.training.global_batch_size,
                      "seq_length": a.data.seq_length}, show=False)


def train(run) -> dict:
    """Train from run.start_iteration to --train-iters; return the final numbers."""
    a, log, done = run.args, run.args.logging, run.start_iteration
    if done >= a.training.train_iters:  # resumed from a checkpoint at or past the end
        run.logger.print(f"the run is complete at iteration {done} (--train-iters "
                         f"{a.training.train_iters}): nothing to train; to extend it, pass "
                         f"--train-iters N with N > {done}")
        return {"train_loss": None, "valid_loss": None, "losses": [], "steps": [],
                "complete": True}
    _header(run)
    progress = _Progress(run)
    start = time.perf_counter()
    watch = SkipWatch(a, run.start_iteration, run.logger.print)
    with StopSignals() as stop:
        steps, valid = _steps(run, progress, watch, stop)
    progress.close()
    return _summary(run, steps, valid, time.perf_counter() - start)


def _steps(run, progress, watch: SkipWatch, stop: StopSignals) -> tuple[list, float | None]:
    """The iterations (log, evaluate, save); after a SIGINT / SIGTERM the step under way
    finishes, is saved, and TrainingInterrupted ends the run."""
    a, log = run.args, run.args.logging
    steps, valid = [], None
    window_start, window_steps = time.perf_counter(), 0
    for it in range(run.start_iteration, a.training.train_iters):
        step_start = time.perf_counter()
        seed_step(a.training.seed, it, run.state)
        result = run.engine.train_step(run.data.train_batch(it, run.state))
        steps.append(result)
        window_steps += 1
        progress.update(result.loss, tokens_per_step(a) / (time.perf_counter() - step_start))
        n = it + 1
        watch.after_step(n, result)
        if n % log.log_interval == 0:
            seconds = time.perf_counter() - window_start
            run.logger.write(_log_record(run, n, result, seconds, window_steps, watch.total))
            if not run.logger.records[:-1] and run.data.device.type == "cpu" and \
                    n < a.training.train_iters:  # the first line of this segment
                run.logger.print(speed_note(a.training.train_iters - n, seconds / window_steps,
                                            torch.get_num_threads(), os.cpu_count() or 1,
                                            os.getloadavg()[0], bool(a.training.cpu_threads)))
            window_start, window_steps = time.perf_counter(), 0
        if n % log.eval_interval == 0 or n == a.training.train_iters:
            valid = evaluate(run)
            if valid is not None:
                run.logger.write({"iteration": n, "valid_loss": valid})
        saved = None
        if a.checkpoint.save and saved_iterations(a, run.start_iteration, [n]):
            saved = _save(run, n, watch, result, valid)
        signum = stop.agreed(run.state, run.data.device)
        if signum:
            if a.checkpoint.save and saved is None:
                saved = _save(run, n, watch, result, valid)
            progress.close()
            raise TrainingInterrupted(interrupted_message(signum, n, saved, a.checkpoint.save),
                                      signum)
        if a.training.exit_interval and n % a.training.exit_interval == 0:
            break
    return steps, valid


def _summary(run, steps: list, valid, elapsed) -> dict:
    a = run.args
    losses = [r.loss for r in steps]
    tail = losses[-SUMMARY_STEPS:] or [math.nan]
    train_loss = sum(tail) / len(tail)
    tok_s = len(steps) * tokens_per_step(a) / max(elapsed, 1e-9)
    out = {"train_loss": train_loss, "valid_loss": valid, "unigram_entropy": run.entropy,
           "tokens_per_s": tok_s, "seconds": elapsed, "losses": losses, "steps": steps}
    if a.logging.generate_tokens:
        k = a.logging.generate_top_k
        # No KV cache: the training layout may shard the sequence, and the engine's model
        # may gather its parameters in forward hooks (FSDP2, ZeRO-3).
        text = generate(run.engine.model, a.logging.prompt, a.logging.generate_tokens,
                        greedy=k == 1, top_k=k, temperature=0.8, seed=a.training.seed,
                        tokenizer=run.data.tokenizer, cache=False,
                        max_context=a.data.seq_length)
        how = "greedy" if k == 1 else f"top-{k} sampling, temperature 0.8"
        run.logger.print(f"sample ({how}):\n{text}")
    done = f"done: {len(steps)} steps in {elapsed:.0f} s"
    last = f"train loss {train_loss:.3f} (last {len(tail)} iterations)"
    if valid is None:
        run.logger.print(f"{done}, {last}")
        return out
    gap = run.entropy - valid
    where = "below" if gap >= 0 else "ABOVE"
    run.logger.print(f"{done}, {tok_s:,.0f} tokens/s | {last}, valid loss {valid:.3f} nats/token: "
                     f"{abs(gap):.3f} {where} the unigram entropy {run.entropy:.3f} of the data "
                     f"({abs(100 * gap / run.entropy):.0f}%)")
    return out
