"""Context parallelism (ring attention) against Ulysses and PyTorch's own context-parallel SDPA,
same run, and the longest sequence each trains.

    python -m bench.context_parallel_bench --gpus 2 --out cp2.json     # 2 GPUs, < 10 min
    python -m bench.context_parallel_bench --gpus 4 --out cp4.json     # 4 GPUs
    python -m bench.context_parallel_bench --gpus 2 --dry-run          # CPU, gloo, tiny

Model: LLaMA-8B-like, 8 layers of 4096, 32 query / 8 kv heads, SwiGLU 14336, vocabulary
32000, bf16 weights, micro-batch 1, full recompute; one timed step is the forward and backward
of the whole model with its loss (no optimizer: the same for every row). Rows, each a torchrun
child of its own (an out-of-memory rank fails its row, not the run):

- 2 GPUs: at 64k tokens, CP 2 (megazoo's ring), Ulysses sp 2, and PyTorch's context-parallel
  SDPA (`torch.distributed.tensor.experimental.context_parallel`, as torchtitan uses it:
  the one-process megazoo model, ids and labels sharded by its head-tail load balancer, SDPA
  patched into its ring); then the longest sequence CP 2 and Ulysses 2 train, doubling from
  128k (one step each).
- 4 GPUs: at 128k, CP 4, Ulysses 2 x CP 2, Ulysses 4 and PyTorch's CP 4; the longest for
  CP 4 and Ulysses 4.

Each row has tokens/s (sequence / step time), peak memory, megazoo's rows the first step's
loss (the same weights and tokens in every layout: CP and Ulysses agree to bf16 rounding, a
check of the GPU ring in the same run), and the planner's prediction of
the same forward and backward (compute + tp/sp/ring communication of `python -m megazoo.plan
--cluster h200`): `of_plan` = measured / predicted tokens/s. Rows run one after the other
until `--budget` seconds are spent (the rest say so). NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set for every child.
"""
from __future__ import annotations

import argparse
import json
import os
import time

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
for _key, _value in NO_MULTICAST.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402  (after the environment above)
import torch.distributed as dist  # noqa: E402

from bench.common import (RESULT, child_env, environment, failure_line, module_command,  # noqa: E402
                          print_table, results, run_command, time_ms, torchrun, write_json)

SHAPE = dict(family="llama", num_layers=8, hidden_size=4096, num_attention_heads=32,
             num_key_value_heads=8, ffn_hidden_size=14336, vocab_size=32000, recompute="full")
TINY = dict(family="llama", num_layers=2, hidden_size=64, num_attention_heads=8,
            num_key_value_heads=2, ffn_hidden_size=128, vocab_size=256, recompute="full")
K = 1024


def rows_for(gpus: int, dry: bool) -> tuple[list[dict], list[dict]]:
    """(timed rows, longest-sequence searches) for a machine of `gpus` GPUs."""
    seq = 64 if dry else (64 if gpus == 2 else 128) * K
    timed = [dict(name=f"cp{gpus}", cp=gpus, sp=1), dict(name=f"ulysses{gpus}", cp=1, sp=gpus)]
    if gpus == 4:
        timed.insert(1, dict(name="ulysses2_cp2", cp=2, sp=2))
    timed.append(dict(name=f"torch_cp{gpus}", cp=gpus, sp=1, torch_cp=True))
    longest = [dict(name=f"cp{gpus}", cp=gpus, sp=1), dict(name=f"ulysses{gpus}", cp=1, sp=gpus)]
    for row in timed + longest:
        row["seq"] = seq
    return timed, longest


# -- the child: one row on every rank ----------------------------------------------------------

def build(args, device):
    """The model of this row on this rank, random bf16 weights (built on meta, filled on the
    device: no init pass over 2.7 B weights on the host)."""
    from megazoo.models import ModelConfig, build_model
    from megazoo.parallel import ParallelConfig, ParallelState

    shape = TINY if args.dry_run else SHAPE
    config = ModelConfig(max_position_embeddings=args.seq, **shape)
    if args.torch_cp:  # one-process model; PyTorch's CP shards the buffers and patches SDPA
        state = None
        config = ModelConfig(max_position_embeddings=args.seq, attention_backend="sdpa", **shape)
    else:
        state = ParallelState.initialize(ParallelConfig(cp=args.cp, sp=args.sp))
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    model = build_model(config, state, device="meta", dtype=dtype).to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.check_inputs = False  # as training runs it: no device sync per forward
    return model, config


def child(args) -> None:
    backend = "gloo" if args.dry_run else "nccl"
    if not args.dry_run:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda")
    model, config = build(args, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=g).to(device)
    labels = ids.clone()
    step = _torch_cp_step(model, ids, labels) if args.torch_cp else _step(model, ids, labels)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = time_ms(step, device, warmup=args.warmup, iters=args.iters)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
    if dist.get_rank() == 0:
        extra = getattr(step, "mode", {})
        print(RESULT + json.dumps({"ms": ms, "tokens_per_s": args.seq / (ms / 1e3),
                                   "peak_gb": peak, **extra, **environment(device)}), flush=True)
    dist.destroy_process_group()


def _step(model, ids, labels):
    mode = {}

    def step():
        loss = model(ids, labels=labels)
        loss.backward()
        mode.setdefault("loss", loss.item())  # the first step's: rows share their weights
        for p in model.parameters():
            p.grad = None
    step.mode = mode
    return step


def _torch_cp_step(model, ids, labels):
    """PyTorch's context parallel around the one-process model. If its ring refuses SDPA's
    grouped-query call (enable_gqa), the kv heads are expanded before SDPA (`_expand_gqa`)
    and the result says so (gqa: "expanded")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(ids.device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
    mode = {"gqa": "native"}

    def once():
        with context_parallel(mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1]):
            if mode["gqa"] == "expanded":
                with _expand_gqa():
                    model(ids, labels=labels).backward()
            else:
                model(ids, labels=labels).backward()  # its loss: this rank's shard's mean
        for p in model.parameters():
            p.grad = None

    def step():
        try:
            once()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            if mode["gqa"] == "expanded":
                raise
            print(f"torch context_parallel failed ({str(exc)[:120]}); retrying with the kv heads "
                  f"expanded", flush=True)
            mode["gqa"] = "expanded"
            once()
    step.mode = mode
    return step


class _expand_gqa:
    """Within: F.scaled_dot_product_attention(..., enable_gqa=True) calls the (patched) SDPA
    with k and v repeated to the query heads instead."""

    def __enter__(self):
        import torch.nn.functional as F

        self.inner = F.scaled_dot_product_attention

        def sdpa(q, k, v, *args, enable_gqa=False, **kwargs):
            if enable_gqa and k.shape[1] != q.shape[1]:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            return self.inner(q, k, v, *args, **kwargs)
        F.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.scaled_dot_product_attention = self.inner
        return False


# -- the parent: rows one after the other, the planner's prediction, the table ----------------

def plan_tokens_s(row: dict, dry: bool) -> float | None:
    """The planner's tokens/s of this row's forward and backward (stage 0's compute + tp/sp
    and ring communication) on an h200 cluster."""
    if dry:
        return None
    import dataclasses

    from megazoo.plan.cli import plan_parser
    from megazoo.plan.clusters import load_cluster
    from megazoo.plan.layout import resolve
    from megazoo.plan.published import plan_args
    from megazoo.plan.timing import step_time

    flags = ["--family", "llama", "--num-layers", "8", "--hidden-size", "4096",
             "--num-attention-heads", "32", "--num-key-value-heads", "8",
             "--ffn-hidden-size", "14336", "--seq-length", str(row["seq"]),
             "--max-position-embeddings", str(row["seq"]), "--micro-batch-size", "1", "--bf16",
             "--global-batch-size", "1", "--recompute", "full",
             "--context-parallel-size", str(row["cp"]), "--sequence-parallel-size", str(row["sp"])]
    args, config, _ = plan_args(plan_parser().parse_args(flags))
    config = dataclasses.replace(config, vocab_size=SHAPE["vocab_size"])
    stage = step_time(args, resolve(args), load_cluster("h200"), config).stages[0]
    return row["seq"] / (stage.compute + stage.tp_comm)


def run_row(row: dict, ns, gpus: int, timeout: float, steps: int | None = None) -> dict:
    """Run one row as a torchrun child; its result, or why it failed."""
    cmd = module_command("context_parallel_bench", torchrun(gpus)) + [
        "--child", "--cp", str(row["cp"]), "--sp", str(row["sp"]), "--seq", str(row["seq"]),
        "--warmup", str(0 if steps else ns.warmup), "--iters", str(steps or ns.iters)]
    cmd += ["--torch-cp"] if row.get("torch_cp") else []
    cmd += ["--dry-run"] if ns.dry_run else []
    start = time.monotonic()
    rc, out, err = run_command(cmd, timeout=max(timeout, 1.0), env=child_env(**NO_MULTICAST))
    found = results(out)
    base = {k: row[k] for k in ("name", "cp", "sp", "seq")} | {"wall_s": time.monotonic() - start}
    if rc == 0 and found:
        return base | found[0] | {"ok": True}
    why = "timeout" if rc is None else failure_line(err)
    return base | {"ok": False, "error": why}


def longest(rows: list[dict], ns, gpus: int, deadline: float) -> list[dict]:
    """For each row, double the sequence from 2x its own until a step fails (one step per
    probe); the rows take turns at each length, so a budget cut leaves them even."""
    found = [{"name": r["name"], "longest": None, "failed_at": None, "error": None}
             for r in rows]
    seq = rows[0]["seq"] * 2
    while any(f["failed_at"] is None for f in found):
        for row, f in zip(rows, found):
            if f["failed_at"] is not None:
                continue
            if time.monotonic() >= deadline:
                return _spent(found, "budget spent")
            probe = run_row(row | {"seq": seq}, ns, gpus, deadline - time.monotonic(), steps=1)
            if probe["ok"]:
                f["longest"] = seq
            elif probe.get("error") == "timeout":  # the budget ran out, not the memory
                return _spent(found, f"budget spent during the probe at {seq}")
            else:
                f["failed_at"], f["error"] = seq, probe.get("error")
        seq *= 2
    return found


def _spent(found: list[dict], why: str) -> list[dict]:
    """Mark the searches still going as cut by the budget."""
    for f in found:
        if f["failed_at"] is None:
            f["error"] = why
    return found


def parent(ns) -> int:
    deadline = time.monotonic() + ns.budget
    timed, searches = rows_for(ns.gpus, ns.dry_run)
    rows = []
    for row in timed:
        left = deadline - time.monotonic()
        result = run_row(row, ns, ns.gpus, left) if left > 0 else row | {"ok": False,
                                                                          "error": "budget spent"}
        plan = plan_tokens_s(row, ns.dry_run)
        if plan and result.get("tokens_per_s"):
            result |= {"plan_tokens_per_s": plan, "of_plan": result["tokens_per_s"] / plan}
        rows.append(result)
        print(json.dumps(result), flush=True)
    speed = {r["name"]: r.get("tokens_per_s") for r in rows}
    ours = speed.get(f"cp{ns.gpus}")
    for r in rows:  # each row against megazoo's CP
        if ours and r.get("tokens_per_s"):
            r["cp_vs_this"] = ours / r["tokens_per_s"]
    print_table(rows, ["name", "seq", "ms", "tokens_per_s", "peak_gb", "loss",
                       "plan_tokens_per_s", "of_plan", "cp_vs_this", "error"])
    found = longest(searches, ns, ns.gpus, deadline)
    print_table(found, ["name", "longest", "failed_at", "error"])
    write_json(ns.out, {"gpus": ns.gpus, "rows": rows, "longest": found, "env": NO_MULTICAST})
    return 0 if all(r["ok"] for r in rows if not r["name"].startswith("torch")) else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, choices=(2, 4))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--budget", type=float, default=560.0, help="seconds for all rows")
    p.add_argument("--dry-run", action="store_true", help="tiny float32 run on CPU with gloo")
    p.add_argument("--out", help="write the results as JSON here")
    child_flags = p.add_argument_group("one row (the parent's children)")
    child_flags.add_argument("--child", action="store_true")
    child_flags.add_argument("--cp", type=int, default=1)
    child_flags.add_argument("--sp", type=int, default=1)
    child_flags.add_argument("--seq", type=int, default=64 * K)
    child_flags.add_argument("--torch-cp", action="store_true")
    ns = p.parse_args(argv)
    if ns.dry_run and not ns.child:
        ns.warmup, ns.iters = 0, 1
    return ns


def main(argv=None) -> int:
    ns = parse_args(argv)
    if ns.child:
        child(ns)
        return 0
    return parent(ns)


if __name__ == "__main__":
    raise SystemExit(main())
