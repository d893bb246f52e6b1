"""DeepSpeed's answer to "larger than host memory", ZeRO-Infinity (ZeRO-3 with its parameters
and optimizer state offloaded to NVMe), on the disk megazoo's largest uses: the rows
`infinity`, `infinity-largest` and `plain-at` of bench/offload_bench.py.

    ds = ds_json(shape, nvme)             # the zero_optimization / aio sections it runs with
    need = disk_need(shape)               # bytes DeepSpeed puts under --nvme-path
    sizes = infinity_sizes(free, host)    # the layer counts `infinity-largest` tries, largest first

The shapes are the 5.2B LLaMA of offload_bench (h 4096, 32 heads, 8 kv heads, ffn 14336) at
a number of layers: one layer is 0.22B parameters, a fine enough step for the search.

What goes on disk (`disk_need`), per parameter: the bf16 parameter (2 B, `offload_param`) and
the optimizer's fp32 master, exp_avg, exp_avg_sq and fp32 gradient (16 B: DeepSpeed's
partitioned optimizer swapper writes the gradients of a sub-group beside its state), plus 2%
for its 4 KiB-aligned files. DeepSpeed cannot split the optimizer state between host memory
and disk as the plain engine does: with `offload_optimizer.device` nvme all of it is on disk,
so its largest is bounded by the free disk alone.

What it pins on the host (`pinned_bytes`): `offload_param.buffer_count` parameter buffers of
`buffer_size` bf16 elements and `offload_optimizer.buffer_count` fp32 buffers of the largest
sub-group. DeepSpeed asserts that a parameter buffer holds the largest sub-group, so the
sub-group is 1e8 elements and the parameter buffer that plus the largest weight (its default
1e9-element sub-groups would pin 40 GB); each parameter swapped in takes a whole buffer, so
there are 16 of them and at most two layers' parameters stay live (DeepSpeed's 1e9
elements would hold four layers of this shape, more weights than buffers).

The GPU builds the whole fp32 model before DeepSpeed partitions it (megazoo's DeepSpeed path
does not build under `deepspeed.zero.Init`): 4 B per parameter on the GPU, far from the limit
at the sizes the disk allows.
"""
from __future__ import annotations

import json
import os
import shutil

from bench import offload_largest as largest

BIG = dict(family="llama", layers=24, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=2048,
           micro=1)
VOCAB = 2048  # the default corpus' tokenizer
DISK_BYTES_PER_PARAM = 2 + 16  # bf16 parameter + fp32 master, two moments, gradient
DISK_SLACK = 1.02  # DeepSpeed's aligned swap files
SUB_GROUP = 100_000_000
# a swapped-in parameter takes a whole buffer: the layer computing, the one prefetched and
# those kept live (2 layers' elements, 4 weights a layer) need 12; DeepSpeed's default is 5
PARAM_BUFFERS, OPTIMIZER_BUFFERS = 16, 4
DISK_SHARE = 0.9  # of the free disk DeepSpeed may fill
HOST_SHARE = 0.5  # of MemAvailable its pinned buffers may take (the rest: the process, data)
TRIES = 2  # sizes tried per call: a failed size costs a start-up and its disk writes
STEP_DOWN = 0.85  # the next try's parameters, of the failed one's


def padded(vocab: int, multiple: int = 128) -> int:
    """The vocabulary as the model holds it (--make-vocab-size-divisible-by 128)."""
    return -(-vocab // multiple) * multiple


def num_parameters(shape: dict, vocab: int = VOCAB) -> int:
    """Parameters of the LLaMA `shape`: layers (attention with GQA, SwiGLU MLP, two norms),
    the untied embedding and output head (padded vocabulary), the final norm."""
    h = shape["hidden"]
    return shape["layers"] * layer_parameters(shape) + 2 * padded(vocab) * h + h


def layer_parameters(shape: dict) -> int:
    """One layer's: q, kv (GQA), output, the SwiGLU MLP's three matrices, two norms."""
    h, ffn = shape["hidden"], shape["ffn"]
    kv_width = h // shape["heads"] * shape["kv_heads"]
    return 2 * h * h + 2 * h * kv_width + 3 * h * ffn + 2 * h


def largest_weight(shape: dict, vocab: int = VOCAB) -> int:
    """Elements of the largest weight: the MLP's fused gate and up projection (2 ffn x h),
    or the embedding / head."""
    return shape["hidden"] * max(2 * shape["ffn"], padded(vocab))


def disk_need(shape: dict) -> float:
    """Bytes ZeRO-Infinity writes under --nvme-path for `shape` (module docstring)."""
    return num_parameters(shape) * DISK_BYTES_PER_PARAM * DISK_SLACK


def sub_group(shape: dict) -> int:
    """sub_group_size: SUB_GROUP, or the whole model when smaller (the dry run's)."""
    return min(SUB_GROUP, num_parameters(shape))


def buffer_elements(shape: dict) -> int:
    """offload_param.buffer_size: the largest sub-group (a sub-group closes after the weight
    that brings it past sub_group_size elements)."""
    return sub_group(shape) + largest_weight(shape)


def pinned_bytes(shape: dict) -> float:
    """Host bytes DeepSpeed's swappers pin for `shape` (module docstring)."""
    n = buffer_elements(shape)
    return PARAM_BUFFERS * n * 2 + OPTIMIZER_BUFFERS * n * 4


def ds_json(shape: dict, nvme: str, param_device: str = "nvme") -> dict:
    """The ds_config ZeRO-Infinity runs `shape` with: both offloads under `nvme`, the swap
    buffers sized to the shape, pipelined optimizer swaps (its best: reads of the next
    sub-group and writes of the last overlap the step of this one)."""
    param = {"device": param_device, "pin_memory": True}
    if param_device == "nvme":
        param.update(nvme_path=nvme, buffer_count=PARAM_BUFFERS, buffer_size=buffer_elements(shape))
    return {"zero_optimization": {
        "stage": 3, "sub_group_size": sub_group(shape), "offload_param": param,
        "stage3_max_live_parameters": 2 * layer_parameters(shape),
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True,
                              "buffer_count": OPTIMIZER_BUFFERS, "pipeline_read": True,
                              "pipeline_write": True}},
        "aio": {"block_size": 1048576, "queue_depth": 16, "thread_count": 1,
                "single_submit": False, "overlap_events": True}}


def infinity_sizes(disk_free: float, host_free: float, max_layers: int | None = None,
                   base: dict = BIG) -> list[int]:
    """The layer counts `infinity-largest` tries (at most TRIES, largest first): the most
    layers whose disk need fits DISK_SHARE of `disk_free` and whose pinned buffers fit
    HOST_SHARE of `host_free` (bytes), at most `max_layers`; then STEP_DOWN of its parameters."""
    def fits(layers):
        s = dict(base, layers=layers)
        return (disk_need(s) <= DISK_SHARE * disk_free and
                pinned_bytes(s) <= HOST_SHARE * host_free and
                (max_layers is None or layers <= max_layers))

    top = 0
    while fits(top + 1):
        top += 1
    sizes = [top] if top else []
    while sizes and len(sizes) < TRIES:
        target = STEP_DOWN * num_parameters(dict(base, layers=sizes[-1]))
        nxt = max((n for n in range(1, sizes[-1]) if num_parameters(dict(base, layers=n))
                   <= target), default=0)
        if not nxt:
            break
        sizes.append(nxt)
    return sizes


def write_config(shape: dict, nvme: str, folder: str, param_device: str) -> str:
    path = os.path.join(folder, "infinity_ds.json")
    with open(path, "w") as f:
        json.dump(ds_json(shape, nvme, param_device), f, indent=1)
    return path


def engine_flags(config: str, nvme: str, param_device: str) -> list[str]:
    return ["--deepspeed", "--zero-stage", "3", "--offload-optimizer", "nvme",
            "--offload-param", param_device, "--nvme-path", nvme, "--deepspeed_config", config]


def infinity_row(name: str, shape: dict, nvme_root: str, param_device: str, gb: int,
                 iters: int, dry: bool, left, pretrain_row, model_flags, tiny: dict) -> dict:
    """ZeRO-Infinity trains `shape` `iters` steps at global batch `gb` (micro-batch 1); the
    swap files under `nvme_root`/infinity are measured, then removed (the next row's disk)."""
    nvme = os.path.join(nvme_root, "infinity")
    shutil.rmtree(nvme, ignore_errors=True)
    os.makedirs(nvme)
    config = write_config(tiny if dry else shape, nvme, nvme_root, param_device)
    flags = engine_flags(config, nvme, param_device)
    planned = {"command": " ".join(["python", "pretrain_gpt.py", *model_flags(shape), *flags]),
               "num_parameters": num_parameters(shape), "disk_per_gpu": disk_need(shape),
               "host_per_gpu": pinned_bytes(shape)}
    row = largest.largest_rows(name, planned, [gb], iters, dry, left, pretrain_row, tiny,
                               dry_flags=flags)[0]
    row.update(layers=shape["layers"], param_device=param_device)
    shutil.rmtree(nvme, ignore_errors=True)
    return row


def plain_at(shape: dict, nvme_root: str, gb: int, iters: int, dry: bool, left,
             pretrain_row, model_flags, tiny: dict) -> dict:
    """megazoo's plain offload (bf16 main gradients, the disk tier under `nvme_root`/plain) at
    `shape`, at the lowest fraction the planner fits on this GPU (its best: what fits on the
    GPU stays there; the row's name says the fraction)."""
    nvme = largest.nvme_dir(os.path.join(nvme_root, "plain"))
    fraction = largest.planned_fraction(largest.machine_budgets(None, dry), model_flags(shape), gb)
    fraction = 1.0 if fraction is None else fraction
    flags = [*largest.PLAIN, "--optimizer-offload-fraction", str(fraction), "--nvme-path", nvme]
    planned = {"command": " ".join(["python", "pretrain_gpt.py", *model_flags(shape), *flags]),
               "num_parameters": num_parameters(shape)}
    row = largest.largest_rows(f"plain-at L{shape['layers']} f={fraction}", planned, [gb], iters,
                               dry, left, pretrain_row, tiny, dry_flags=flags)[0]
    row["layers"] = shape["layers"]
    return row


ROWS = ("infinity", "infinity-largest", "plain-at")
SMALL = dict(BIG, layers=8, hidden=2048, heads=16, kv_heads=8, ffn=5632)  # 0.39B: a quick check
PLAIN_RESERVE = 150.0  # seconds `infinity-largest` leaves for the `plain-at` row after it


def add_arguments(ap) -> None:
    ap.add_argument("--infinity-gb", type=int, default=2,
                    help="global batch of the ZeRO-Infinity and plain-at rows (micro-batch 1)")
    ap.add_argument("--infinity-param-device", choices=("nvme", "cpu"), default="nvme",
                    help="where ZeRO-Infinity keeps its bf16 parameters (the optimizer state "
                         "is on nvme either way)")
    ap.add_argument("--infinity-layers", type=int,
                    help="layers of the 4096-wide LLaMA: the most infinity-largest tries (after "
                         "a failed call: the size it names next), the size plain-at trains "
                         "when no ZeRO-Infinity row ran before it in the call")


def run_row(row: str, a, dry: bool, left, pretrain_row, model_flags, tiny: dict,
            done: dict) -> list[dict]:
    """One of ROWS (offload_bench's `pretrain_row` and `model_flags` run them); `done`
    carries the shape ZeRO-Infinity last trained to `plain-at`."""
    if not a.nvme_path:
        return [{"row": row, "error": "needs --nvme-path DIR (the disk the swap files go on)"}]
    os.makedirs(a.nvme_path, exist_ok=True)
    run = dict(param_device=a.infinity_param_device, gb=a.infinity_gb, iters=a.largest_iters,
               dry=dry, pretrain_row=pretrain_row, model_flags=model_flags, tiny=tiny)
    if row == "infinity":
        name = f"infinity {num_parameters(SMALL) / 1e9:.2f}B"
        out = infinity_row(name, SMALL, a.nvme_path, left=left, **run)
        if "error" not in out:
            done["shape"] = SMALL
        return [out]
    if row == "plain-at":
        if a.infinity_layers and "shape" not in done:
            done["shape"] = dict(BIG, layers=a.infinity_layers)
        if "shape" not in done:
            return [{"row": row, "error": "no ZeRO-Infinity row trained before it: put "
                                          "infinity or infinity-largest first in --rows, or "
                                          "pass --infinity-layers"}]
        run.pop("param_device")
        return [plain_at(done["shape"], a.nvme_path, left=left, **run)]
    return largest_search(a, left, run, done)


def largest_search(a, left, run: dict, done: dict) -> list[dict]:
    """ZeRO-Infinity's largest: the sizes `infinity_sizes` allows on this disk and host,
    largest first, until one trains; the time after it is kept for `plain-at`."""
    for name in ("infinity", "plain"):  # earlier calls' files hide free disk
        shutil.rmtree(os.path.join(a.nvme_path, name), ignore_errors=True)
    budgets = largest.machine_budgets(None, run["dry"])  # GB; the host: MemAvailable
    host = float(budgets[budgets.index("--host-memory") + 1]) * 1e9
    disk = shutil.disk_usage(a.nvme_path).free
    sizes = infinity_sizes(disk, host, a.infinity_layers)
    shapes = [dict(BIG, layers=n) for n in sizes]
    note = {"row": "infinity-largest sizes", "disk_free_gb": disk / 1e9,
            "host_free_gb": host / 1e9, "layers": sizes,
            "parameters": [num_parameters(s) for s in shapes],
            "disk_need_gb": [disk_need(s) / 1e9 for s in shapes],
            "pinned_gb": [pinned_bytes(s) / 1e9 for s in shapes]}
    print(json.dumps(note), flush=True)
    rows = [note] if sizes else [dict(note, error="no size fits this disk and host")]
    reserve = PLAIN_RESERVE if "plain-at" in a.rows else 0.0
    for layers in sizes:
        if left() - reserve < 60:
            rows.append({"row": f"infinity-largest L{layers}", "error": "no time left"})
            break
        shape = dict(BIG, layers=layers)
        row = infinity_row(f"infinity-largest L{layers}", shape, a.nvme_path,
                           left=lambda: left() - reserve, **run)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if "error" not in row:
            done["shape"] = shape
            break
    return rows
