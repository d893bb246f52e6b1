"""The planner's command line: pretrain_gpt.py's flags, the run's checks, one-line errors."""
import json
import subprocess
import sys

import pytest

from megazoo.config.flags import build_parser, parse_args
from megazoo.plan import main
from megazoo.plan.cli import plan_parser

BAD = [  # flags the run rejects at parsing, and so must the planner
    ["--model", "gpt-1.3b", "--tp", "3"],               # 16 heads over tp 3
    ["--model", "bloom-176b", "--tp", "3"],
    ["--model", "bloom-176b", "--tp", "5"],
    ["--model", "gpt-125m", "--pp", "5"],               # 12 layers over pp 5
    ["--model", "llama-7b", "--sequence-parallel-size", "3"],
    ["--tp", "2", "--sequence-parallel", "--seq-length", "127"],
    ["--seq-length", "1024"],                           # past the default model's 512 positions
    ["--zero-stage", "2"],                              # ZeRO without a ZeRO engine
    ["--deepspeed", "--pp", "2"],
    ["--zero-impl", "fsdp2", "--zero-stage", "2"],
    ["--zero-impl", "fsdp2", "--offload-optimizer", "cpu", "--offload-optimizer-ratio", "0.5"],
    ["--deepspeed", "--zero-stage", "2", "--offload-param", "cpu"],
    ["--deepspeed", "--zero-stage", "0", "--offload-optimizer", "cpu"],
    ["--no-fsdp-reshard-after-forward"],
    ["--zero-stage", "4"],
]


@pytest.mark.parametrize("argv", BAD, ids=lambda a: " ".join(a))
def test_planner_rejects_what_the_run_rejects_with_its_message(argv, capsys):
    with pytest.raises(ValueError) as run_error:
        parse_args(argv)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {run_error.value}\n"  # one line, the run's own words


def test_run_accepts_what_the_planner_plans(capsys):
    argv = ["--model", "gpt-1.3b", "--tp", "2", "--sequence-parallel", "--seq-length", "2048",
            "--micro-batch-size", "1"]
    parse_args(argv)
    assert main(argv) == 0 and "fits in 80 GB" in capsys.readouterr().out


def test_every_run_flag_is_a_plan_flag_with_its_default():
    run, plan = build_parser(), plan_parser()
    plan_actions = plan._option_string_actions
    for flag, action in run._option_string_actions.items():
        if flag in ("-h", "--help"):
            continue
        assert flag in plan_actions, flag
        other = plan_actions[flag]
        assert (other.dest, other.default, other.choices) == \
            (action.dest, action.default, action.choices), flag
    extra = set(plan_actions) - set(run._option_string_actions)
    assert extra == {"--dp", "--gpu-memory", "--gpus-per-node", "--fp32-grad-accumulation",
                     "--host-memory", "--disk-memory", "--largest", "--model-family",
                     "--json", "--out", "--cluster", "--search", "--top", "--gpus"}


@pytest.mark.parametrize("argv, hint", [
    (["--model", "gpt-1.3"], "did you mean --model gpt-1.3b?"),
    (["--offload-params", "cpu"], "did you mean --offload-param?"),
    (["--model", "foo"], "--model 'foo' is not one of its choices"),
])
def test_cli_errors_are_one_line_exit_2(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m megazoo.plan: error: ") and err.count("\n") == 1
    assert hint in err


def test_cli_json_reports_exact_count(capsys):
    assert main(["--model", "bloom-176b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_parameters"] == 176247271424 and out["layout"]["dp"] == 1


def test_cli_module_entry_point_takes_pretrain_flags():
    cmd = [sys.executable, "-m", "megazoo.plan", "--model", "bloom-176b", "--dp", "8",
           "--deepspeed", "--zero-stage", "3", "--offload-optimizer", "cpu",
           "--recompute-granularity", "full", "--micro-batch-size", "1",
           "--global-batch-size", "8", "--seq-length", "2048", "--gpu-memory", "80", "--bf16"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "does NOT fit" in out and "176,247,271,424" in out and "83.47 GB" in out


def test_module_error_has_no_traceback():
    cmd = [sys.executable, "-m", "megazoo.plan", "--model", "gpt-1.3b", "--tp", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: num_heads (16) is not divisible by tp*sp = 3*1")



@pytest.mark.parametrize("argv, vocab", [
    ([], 2048),                                    # the default corpus's tokenizer
    (["--default-vocab-size", "4096"], 4096),
    (["--data-path", "corpus", "--tokenizer-type", "GPT2BPETokenizer"], 1000),  # unknown: kept
    (["--model", "gpt-125m"], 50257),              # a preset keeps its own
])
def test_planner_plans_the_vocabulary_the_run_trains_with(argv, vocab, capsys):
    """Without --data-path the run trains on the default corpus, whose tokenizer has
    --default-vocab-size tokens; the plan's parameters are that model's."""
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["args"]["model"]["vocab_size"] == vocab


@pytest.mark.parametrize("argv, says", [
    (["--disk-memory", "50"], "--disk-memory 50 is not used: the plan puts optimizer state on "
                              "disk only with --optimizer-cpu-offload --nvme-path DIR"),
    (["--optimizer-cpu-offload", "--disk-memory", "50"], "only with --nvme-path DIR"),
    ([], "vocabulary 2,048: the default corpus's tokenizer"),
    (["--largest", "--disk-memory", "50"], "--disk-memory 50 is not used"),
])
def test_budgets_and_vocabulary_the_plan_takes_are_said(argv, says, capsys):
    assert main(argv) == 0
    assert says in capsys.readouterr().out


def test_a_preset_or_a_used_disk_budget_gets_no_such_note(tmp_path, capsys):
    assert main(["--model", "gpt-125m", "--micro-batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "vocabulary" not in out and "is not used" not in out
    assert main(["--optimizer-cpu-offload", "--nvme-path", str(tmp_path), "--disk-memory",
                 "50"]) == 0
    assert "is not used" not in capsys.readouterr().out
