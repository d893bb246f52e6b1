"""pretrain_gpt.py's parser: flags generated from the config dataclasses, aliases, presets."""
import pytest
import torch

from megazoo.config.flags import DEFAULT_MODEL, build_parser, field_docs, parse_args
from megazoo.config.run import TrainingConfig
from megazoo.models import PRESETS


def test_megatron_flags_reach_the_configs():
    a = parse_args(["--num-layers", "4", "--hidden-size", "96", "--num-attention-heads", "6",
                    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
                    "--train-iters", "7", "--lr", "1e-3", "--min-lr", "1e-4",
                    "--lr-warmup-iters", "2", "--lr-decay-style", "linear",
                    "--weight-decay", "0.01", "--clip-grad", "0.5", "--bf16",
                    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                    "--sequence-parallel", "--recompute-granularity", "selective",
                    "--save", "ck", "--load", "ck", "--save-interval", "5",
                    "--eval-interval", "3", "--eval-iters", "2", "--log-interval", "1",
                    "--seed", "7", "--split", "98,2,0", "--local_rank", "3"])
    assert (a.model.num_layers, a.model.hidden_size, a.model.num_attention_heads) == (4, 96, 6)
    assert a.model.recompute == "selective"
    t = a.training
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters, t.lr, t.min_lr) == \
        (2, 8, 7, 1e-3, 1e-4)
    assert (t.lr_warmup_iters, t.lr_decay_style, t.weight_decay, t.clip_grad, t.bf16, t.seed) == \
        (2, "linear", 0.01, 0.5, True, 7)
    assert (a.parallel.tp, a.parallel.pp, a.parallel.sequence_parallel) == (2, 2, True)
    assert (a.checkpoint.save, a.checkpoint.load, a.checkpoint.save_interval) == ("ck", "ck", 5)
    assert (a.logging.eval_interval, a.logging.eval_iters, a.logging.log_interval) == (3, 2, 1)
    assert (a.data.seq_length, a.data.split) == (64, "98,2,0")


def test_aliases_and_zero_flags(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    a = parse_args(["--ds-sequence-parallel-size", "2", "--deepspeed", "--deepspeed_config",
                    str(ds), "--zero-stage", "2", "--offload-optimizer", "cpu"])
    assert a.parallel.sp == 2
    assert (a.zero.zero_impl, a.zero.deepspeed_config, a.zero.zero_stage,
            a.zero.offload_optimizer) == ("deepspeed", str(ds), 2, "cpu")
    assert parse_args(["--sequence-parallel-size", "4"]).parallel.sp == 4
    assert parse_args(["--data-path", "0.3", "a", "0.7", "b", "--tokenizer-type",
                       "ByteLevelTokenizer"]).data.data_path == ["0.3", "a", "0.7", "b"]


def test_preset_with_overrides_and_default_model():
    a = parse_args(["--model", "llama-7b", "--num-layers", "2"])
    ref = PRESETS["llama-7b"]
    assert a.model.num_layers == 2 and a.model.hidden_size == ref.hidden_size
    assert a.model.activation == "swiglu" and a.model.ffn_hidden_size == ref.ffn_hidden_size
    assert PRESETS["llama-7b"].num_layers == 32  # the preset itself is untouched
    assert parse_args([]).model == DEFAULT_MODEL
    assert parse_args(["--model", "gpt-125m", "--family", "bloom"]).model.position_embedding \
        == "alibi"


def test_virtual_pipeline_from_layers_per_stage():
    a = parse_args(["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "2"])
    assert a.parallel.vpp == 2
    with pytest.raises(ValueError, match="num-layers-per-virtual-pipeline-stage"):
        parse_args(["--num-layers", "6", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "2"])


@pytest.mark.parametrize("argv, flag", [
    (["--bf16", "--fp16"], "--fp16"),
    (["--lr-decay-style", "exp"], "--lr-decay-style"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr"),
    (["--tokenizer-type", "ByteLevelTokenizer"], "--data-path"),
    (["--zero-stage", "5"], "--zero-stage"),
])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        parse_args(argv)


def test_help_comes_from_field_docstrings():
    docs = field_docs(TrainingConfig)
    assert docs["global_batch_size"].startswith("Sequences per optimizer step")
    text = build_parser().format_help()
    assert "--tensor-model-parallel-size" in text and "Sequences per optimizer step" in text


def test_data_parallel_flags_and_their_errors():
    a = parse_args(["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                    "--ddp-bucket-size", "1000", "--max-skipped-steps", "3", "--fp32"])
    t = a.training
    assert (t.use_distributed_optimizer, t.overlap_grad_reduce, t.overlap_param_gather,
            t.ddp_bucket_size, t.max_skipped_steps, t.fp32) == (True, True, True, 1000, 3, True)
    assert t.accumulate_allreduce_grads_in_fp32
    for argv, words in ((["--overlap-param-gather"], "--use-distributed-optimizer"),
                        (["--no-accumulate-allreduce-grads-in-fp32"], "always fp32"),
                        (["--bf16", "--fp32"], "exclude each other"),
                        (["--max-skipped-steps", "-1"], ">= 0")):
        with pytest.raises(ValueError, match=words):
            parse_args(argv)


def test_plain_engine_flags_are_refused_with_zero_engines():
    from megazoo.training.backends import build_engine

    a = parse_args(["--deepspeed", "--use-distributed-optimizer"])
    with pytest.raises(ValueError, match="--use-distributed-optimizer is for the plain engine"):
        build_engine(a, None, None)


def test_help_shows_every_flags_default():
    parser = build_parser()
    text = " ".join(parser.format_help().split())  # argparse wraps lines
    for shown in ("Optimizer steps to train for. (default: 800)",
                  "(default: checkpoints)", "(default: tp sp dp pp)",
                  "Number of transformer blocks. (default: 4)",       # the no-flag run's model
                  "(default: off) --fp16", "redirected log gets log lines only). (default: on)"):
        assert shown in text, shown
    documented = [a for a in parser._actions if a.help and a.option_strings[0].startswith("--")
                  and a.dest not in ("model_name", "local_rank", "help")]
    assert documented and all("(default: " in a.help for a in documented), \
        [a.option_strings[0] for a in documented if "(default: " not in a.help]


def test_tp_comm_overlap_flag_needs_megatron_sp():
    a = parse_args(["--tp-comm-overlap", "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert a.training.tp_comm_overlap
    assert parse_args(["--tp-comm-overlap", "--sequence-parallel-size", "2"]).training.tp_comm_overlap
    for argv in (["--tp-comm-overlap"], ["--tp-comm-overlap", "--tp", "2"]):
        with pytest.raises(ValueError, match="> 1 with --sequence-parallel, or --sequence-parallel-size"):
            parse_args(argv)


@pytest.mark.parametrize("argv, says", [
    (["--context-parallel-size", "2"], "set --context-parallel-size 1"),
    (["--recompute-granularity", "full"], "drop --recompute-granularity"),
    (["--deepspeed", "--zero-stage", "3"], "plain engine"),
    (["--optimizer-cpu-offload"], "drop --optimizer-cpu-offload"),
    (["--num-attention-heads", "8", "--num-key-value-heads", "1"], "use tp <= 1"),
])
def test_cuda_graph_flag_refuses_what_it_does_not_capture(argv, says):
    graphs = ["--enable-cuda-graph", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert parse_args(graphs).training.enable_cuda_graph
    with pytest.raises(ValueError, match=f"--enable-cuda-graph: .*{says}"):
        parse_args(graphs + argv)


def test_a_gpu_run_with_tp_or_ulysses_is_pointed_at_cuda_graphs():
    from megazoo.training.run import cuda_graph_hint

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # (a device object needs no GPU)
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert "--enable-cuda-graph" in cuda_graph_hint(parse_args(tp2), cuda)
    assert "--enable-cuda-graph" in cuda_graph_hint(parse_args(["--sequence-parallel-size", "2"]), cuda)
    assert "--enable-cuda-graph" in cuda_graph_hint(
        parse_args(tp2 + ["--pipeline-model-parallel-size", "2"]), cuda)  # pipelines capture too
    for argv, device in ((tp2, cpu), (tp2 + ["--enable-cuda-graph"], cuda), ([], cuda),
                         (tp2 + ["--context-parallel-size", "2"], cuda)):
        assert cuda_graph_hint(parse_args(argv), device) is None, argv
