"""The planner's printed launch commands run as pasted: built from the run's parsed config
(`plan.command`), they parse with pretrain_gpt.py's own parser (no planner-only flag such as
--gpu-memory or --host-memory) back to the config that was planned."""
import json
import shlex

from megazoo.config.flags import build_parser, parse_args
from megazoo.plan import main
from megazoo.plan.command import run_argv


def _run_flags(command: str) -> list[str]:
    """The words after `pretrain_gpt.py` of a printed command."""
    words = shlex.split(command)
    return words[words.index("pretrain_gpt.py") + 1:]


def test_search_command_parses_with_the_runs_parser(capsys):
    argv = ["--model", "gpt-125m", "--global-batch-size", "32", "--seq-length", "1024",
            "--bf16", "--gpu-memory", "70", "--host-memory", "500", "--cluster", "h100-sxm",
            "--gpus", "8", "--search", "--top", "2", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    rows = rows["top"]
    assert rows
    for row in rows:
        flags = _run_flags(row["command"])
        assert not {"--gpu-memory", "--host-memory", "--dp", "--cluster"} & set(flags)
        args = parse_args(flags)  # pretrain_gpt.py's parser and checks accept it
        assert args.model_name == "gpt-125m" and args.data.seq_length == 1024


def test_largest_command_with_planner_budgets_parses(capsys):
    argv = ["--largest", "--model-family", "llama", "--gpu-memory=80", "--host-memory", "200",
            "--optimizer-cpu-offload"]
    assert main(argv) == 0
    command = capsys.readouterr().out.split("command:\n", 1)[1].strip()
    flags = _run_flags(command)
    build_parser().parse_args(flags)  # no "unrecognized arguments" (exit 2)
    args = parse_args(flags)
    assert args.training.optimizer_cpu_offload and args.model.family == "llama"


def test_run_argv_round_trips_the_config():
    for argv in ([], ["--model", "gpt-125m", "--num-layers", "4", "--tp", "2", "--bf16",
                      "--no-plot-curves", "--save", "", "--sparse-attention-mode", "fixed"],
                 ["--model", "llama-7b", "--optimizer-cpu-offload", "--lr", "3e-5",
                  "--min-lr", "0", "--optimizer-offload-fraction", "0.3"]):
        args = parse_args(argv)
        assert parse_args(run_argv(args)) == args


def test_run_argv_heads_set_apart_from_the_default_model():
    """Heads other than the default model's, with key/value heads derived (MHA) or set
    (GQA): the command round-trips and names --num-key-value-heads only when set (the MHA
    case raised a ValueError in --search's commands before)."""
    mha = parse_args(["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"])
    gqa = parse_args(["--family", "llama", "--hidden-size", "2048", "--num-attention-heads", "16",
                      "--num-key-value-heads", "4"])
    for args, kv_named in ((mha, False), (gqa, True)):
        words = run_argv(args)
        assert parse_args(words) == args
        assert ("--num-key-value-heads" in words) == kv_named, words
