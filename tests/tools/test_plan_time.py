"""The step-time model (`python -m megazoo.plan ... --cluster C [--search]`): its calibration
against the recorded kernel measurements, monotonicity, our measured runs, published runs,
and that --search returns only layouts the run accepts."""
import dataclasses
import json
import statistics

import pytest

from megazoo.config.flags import args_from_namespace
from megazoo.config.validate import check_args
from megazoo.plan import main
from megazoo.plan.calibration import fit_gemm, kernel_rates, load_fixture
from megazoo.plan.cli import plan_parser
from megazoo.plan.clusters import load_cluster
from megazoo.plan.layout import resolve
from megazoo.plan.search import drop_flags, search
from megazoo.plan.timing import step_time

from helpers.plan_time import predict

GPT_1_3B = ("--family gpt --num-layers 24 --hidden-size 2048 --num-attention-heads 16 "
            "--ffn-hidden-size 8192 --seq-length 2048 --max-position-embeddings 2048 "
            "--micro-batch-size 4 --bf16")
DP2 = " --dp 2 --overlap-grad-reduce --use-distributed-optimizer"
LLAMA_8B_4L = ("--family llama --num-layers 4 --hidden-size 4096 --num-attention-heads 32 "
               "--num-key-value-heads 8 --ffn-hidden-size 14336 --seq-length 4096 "
               "--max-position-embeddings 4096 --micro-batch-size 1 --bf16 --global-batch-size 8")


_predict = predict


def test_the_stored_fit_reproduces_the_recorded_gemms():
    """The fixture's curve against its own measurements: GEMMs of >= 0.1 TFLOP (what large
    layers run) within 12% each and 3% at the median; all of them, tiny ones included, 5% at
    the median (small GEMMs swing with cuBLAS's kernel choice: up to 45%)."""
    data, rates = load_fixture("h100-sxm"), kernel_rates("h100-sxm")
    errors = [(rates.gemm.time(p["m"], p["n"], p["k"]) / (p["ms"] * 1e-3) - 1,
               2 * p["m"] * p["n"] * p["k"]) for p in data["gemm_bf16"]]
    big = [abs(e) for e, flop in errors if flop >= 1e11]
    assert len(big) > 200 and max(big) < 0.12 and statistics.median(big) < 0.03
    assert statistics.median(abs(e) for e, _ in errors) < 0.05
    for row in data["attention"]:  # a line through 10 shapes: within 10% but one (25%)
        fwd, bwd = rates.attention(row["batch"], row["heads"], row["seq"], row["head_dim"])
        assert (fwd + bwd) / (row["fwd_bwd_ms"] * 1e-3) == pytest.approx(1, abs=0.26)
    assert rates.copy_bytes_s == pytest.approx(data["copy_gb_s"] * 1e9)


def test_the_stored_fit_is_what_fitting_gives():
    data = load_fixture("h100-sxm")
    fitted = fit_gemm(data["gemm_bf16"])
    for name, value in data["fit"].items():  # L-BFGS from the same start: the same minimum
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-3), name


@pytest.mark.parametrize("flags, cluster, vocab, measured", [
    # bench/README.md, 1x H100, 2026-11-24 (train_bench.py, vocabulary 2048)
    (GPT_1_3B + " --global-batch-size 8", "h100-sxm", 2048, 61.8e3),
    (GPT_1_3B + " --global-batch-size 32", "h100-sxm", 2048, 66.2e3),
    (LLAMA_8B_4L, "h100-sxm", 2048, 97.6e3),
    # BENCHMARKS.md, 1x H100, 2026-11-25: --fp8-format hybrid 129.2k
    (LLAMA_8B_4L + " --fp8-format hybrid", "h100-sxm", 2048, 129.2e3),
    # bench/results/two_gpu_dp_h100x2_2026-11-25.md, 2x H100, data parallel
    (GPT_1_3B + DP2 + " --global-batch-size 16", "h100-sxm", 2048, 120.7e3),
    (GPT_1_3B + DP2 + " --global-batch-size 64", "h100-sxm", 2048, 130.4e3),
])
def test_our_measured_runs_within_ten_percent(flags, cluster, vocab, measured):
    assert _predict(flags, cluster, vocab).tokens_per_s == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("flags, cluster, published", [
    ("--model bloom-176b --tp 4 --pp 12 --dp 8 --micro-batch-size 2 --global-batch-size 2048 "
     "--seq-length 2048 --bf16 --use-distributed-optimizer --recompute full", "jean-zay", 150),
    ("--model gpt3-175b --tp 8 --pp 16 --dp 8 --micro-batch-size 1 --global-batch-size 1536 "
     "--seq-length 2048 --bf16 --use-distributed-optimizer --recompute full", "selene", 140),
    ("--family gpt --num-layers 128 --hidden-size 25600 --num-attention-heads 160 "
     "--seq-length 2048 --max-position-embeddings 2048 --tp 8 --pp 64 --dp 6 "
     "--micro-batch-size 1 --global-batch-size 3072 --bf16 --use-distributed-optimizer "
     "--recompute full", "selene", 163),
])
def test_published_runs_within_fifteen_percent(flags, cluster, published):
    """Megatron-LM's TFLOP/s per GPU (recompute counted), nothing fitted to these runs."""
    assert _predict(flags, cluster).tflops_per_gpu_megatron == pytest.approx(published, rel=0.15)


def test_bloom_memory_as_its_engine_kept_it_within_fifteen_percent(capsys):
    """About 60 GB per GPU were in use (nvidia-smi: the allocator's reserve counts); megazoo's
    engine would need less (no bf16 gradients beside the fp32 ones), Megatron-DeepSpeed's
    BF16 optimizer kept them."""
    flags = ("--model bloom-176b --tp 4 --pp 12 --dp 8 --micro-batch-size 2 --global-batch-size "
             "2048 --seq-length 2048 --bf16 --use-distributed-optimizer --recompute full "
             "--cluster jean-zay --json")
    assert main(flags.split()) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu_memory_gb_megatron_deepspeed"] == pytest.approx(60, rel=0.15)
    assert out["gpu_memory_gb"] < out["gpu_memory_gb_megatron_deepspeed"]
    assert out["gpu_memory_stage"] == 0 and out["fits"]


LAYOUT = ("--model gpt-1.3b --tp 4 --pp 4 --dp 2 --micro-batch-size 1 --global-batch-size 64 "
          "--seq-length 2048 --bf16 --use-distributed-optimizer")


@pytest.mark.parametrize("field", ["intra_node_gb_s", "inter_node_gb_s_per_node", "hbm_gb_s",
                                   "pcie_gb_s", "peak_bf16_tflops"])
def test_more_bandwidth_or_flops_is_never_slower(field):
    args = args_from_namespace(plan_parser().parse_args(LAYOUT.split()))
    layout = resolve(args)
    for name in ("a100-80gb", "h100-sxm"):
        base = load_cluster(name)
        base = dataclasses.replace(base, gpus_per_node=4)  # tp inside, pp and dp across nodes
        steps = [step_time(args, layout,
                           dataclasses.replace(base, **{field: getattr(base, field) * k})).step_s
                 for k in (0.5, 1, 2, 4)]
        assert all(a >= b for a, b in zip(steps, steps[1:])), (name, steps)
    assert steps[0] > steps[-1] or field == "pcie_gb_s"  # and it matters (no offload: PCIe idle)


def test_more_pipeline_stages_never_shrink_the_bubble():
    """At 16 micro-batches per step, bubble share of the step grows with pp (1F1B and
    interleaved: (p - 1) / (v m) in the ideal case)."""
    for vpp in (1, 2):
        shares = []
        for pp in (1, 2, 4, 8):
            flags = (f"--model gpt-1.3b --pp {pp} --micro-batch-size 1 --global-batch-size 16 "
                     f"--seq-length 2048 --bf16")
            if vpp > 1 and pp > 1:
                flags += f" --num-layers-per-virtual-pipeline-stage {24 // (pp * vpp)}"
            t = _predict(flags, "h100-sxm")
            shares.append(sum(s.bubble for s in t.stages) / len(t.stages) / t.step_s)
        assert all(a <= b + 1e-9 for a, b in zip(shares, shares[1:])), (vpp, shares)
        assert shares[-1] > 0.2


def test_search_returns_only_layouts_the_run_accepts():
    """gpt-125m has 12 heads: tp = 8 (and tp x sp = 8) must be refused, never returned; every
    result, parsed as pretrain_gpt.py parses it, passes the run's checks at its dp."""
    parser = plan_parser()
    base = "--model gpt-125m --global-batch-size 32 --seq-length 1024 --bf16".split()
    found, refused, _ = search(lambda argv: args_from_namespace(parser.parse_args(argv)), base,
                               12, 8, 32, load_cluster("h100-sxm"), rescore=3)
    assert refused > 0 and found
    for c in found:
        dp = int(c.flags[c.flags.index("--dp") + 1])
        run = args_from_namespace(parser.parse_args(base + drop_flags(c.flags, {"--dp"})))
        check_args(dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, dp=dp)))
        assert run.parallel.tp * run.parallel.sp in (1, 2, 4)
        # CUDA graphs where tp or Ulysses run and the run captures them: no context
        # parallelism, no recompute
        p = run.parallel
        graphs = p.tp * p.sp > 1 and p.cp == 1 and run.model.recompute == "none"
        assert run.training.enable_cuda_graph == graphs, c.flags
        assert ("--enable-cuda-graph" in c.command(8)) == graphs
    assert any(c.time.stages[0].host == 0.0 and "--enable-cuda-graph" in c.flags for c in found)
    speeds = [c.time.tokens_per_s for c in found[:3]]
    assert speeds == sorted(speeds, reverse=True)


def test_cli_json_and_one_line_errors(capsys, tmp_path):
    flags = LAYOUT.split() + ["--cluster", "h100-sxm", "--json"]
    assert main(flags) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_s", "tokens_per_s", "tflops_per_gpu", "tflops_per_gpu_megatron",
                "gpu_memory_gb", "stages"):
        assert key in out
    assert len(out["stages"]) == 4 and out["gpus"] == 32
    for stage in out["stages"]:  # the parts of each stage add up to the step
        parts = ("compute", "tp_comm", "host", "bubble", "dp_comm", "optimizer")
        assert sum(stage[k] for k in parts) == pytest.approx(out["step_s"])
    pytest.importorskip("matplotlib")
    assert main(LAYOUT.split() + ["--cluster", "h100-sxm", "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    spec = tmp_path / "mine.json"
    spec.write_text(json.dumps({"gpu": "x", "peak_bf16_tflops": 100, "hbm_gb": 40}))
    assert main(LAYOUT.split() + ["--cluster", str(spec)]) == 2
    assert main(LAYOUT.split() + ["--cluster", "nope"]) == 2
    assert main(LAYOUT.split() + ["--search"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("error: ") for e in err)


@pytest.mark.parametrize("edit, says", [
    ({"gpus_per_node": True}, "gpus_per_node must be an integer, got true"),
    ({"gpus_per_node": 8.0}, "gpus_per_node must be an integer, got 8.0"),
    ({"hbm_gb": False}, "hbm_gb must be a number, got false"),
    ({"pcie_gb_s": "32"}, "pcie_gb_s must be a number, got \"32\""),
])
def test_a_cluster_file_takes_no_bool_or_string_for_a_number(tmp_path, capsys, edit, says):
    spec = json.loads((load_cluster.__globals__["PRESETS_FILE"]).read_text())["h100-sxm"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**spec, **edit}))
    argv = ["--model", "gpt-1.3b", "--micro-batch-size", "1", "--cluster", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_a_cluster_file_holding_a_list_is_one_line(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text("[1, 2]")
    assert main(["--model", "gpt-1.3b", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a JSON list, not an object" in err, err


@pytest.mark.parametrize("impl", ["--deepspeed", "--zero-impl fsdp2"])
def test_zero3_at_pp1_counts_its_gathers_once_as_dp_time(impl):
    """One stage has no pipeline to wait on: no bubble, and ZeRO-3's exposed gathers and
    reduce-scatters appear once, as dp_comm, in the step as in the breakdown (they were
    counted in the step twice, the second time printed as the bubble)."""
    t = _predict(f"--model gpt-1.3b --dp 8 {impl} --zero-stage 3 --micro-batch-size 4 "
                 f"--global-batch-size 64 --bf16", "h100-sxm")
    (stage,) = t.stages
    assert stage.dp_comm > 0.01 and abs(stage.bubble) < 1e-12
    parts = stage.compute + stage.tp_comm + stage.dp_comm + stage.optimizer
    assert abs(t.step_s - parts) < 1e-12


def test_a_search_finding_nothing_names_the_nearest_layout(capsys):
    assert main("--model bloom-176b --cluster h100-sxm --search --gpus 8 --bf16 "
                "--micro-batch-size 1 --global-batch-size 8 --seq-length 2048".split()) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("0 layouts fit on 8 GPUs")
    assert out[1].startswith("why: nothing fits 80 GB per GPU: the nearest, "
                             "--tensor-model-parallel-size 8") and "GB; more GPUs" in out[1]


def test_the_headline_agrees_with_the_fp32_build_note(capsys):
    """BLOOM-176B, ZeRO-3 with parameter offload: training fits in 80 GB, the fp32 build
    (705 GB) does not; the prediction's headline must not say "fits" above that note."""
    assert main("--model bloom-176b --cluster h100-sxm --dp 8 --deepspeed --zero-stage 3 "
                "--offload-optimizer cpu --offload-param cpu --recompute-granularity full "
                "--micro-batch-size 1 --global-batch-size 8 --bf16".split()) == 0
    out = capsys.readouterr().out
    assert "that, not training, does not fit" in out
    assert out.splitlines()[0].endswith("(does NOT fit)")
