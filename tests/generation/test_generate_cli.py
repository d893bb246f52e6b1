"""`generate.py` / `megazoo-generate` end to end: a checkpoint saved by a short pretrain run
(its byte-level tokenizer recorded in megazoo.json), a saved model with an HF tokenizer.json
next to it, the --save folder and iter_* forms of --load, tp = 2 and pp = 2 on gloo ranks,
and bad input (one line on stderr, exit status 2, nothing on stdout)."""
import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megazoo
from megazoo.generation.api import encode_prompt, find_tokenizer
from megazoo.generation.cli import SEPARATOR, main
from megazoo.models import ModelConfig, build_model
from megazoo.testing import run_distributed
from megazoo.training.run import run_training
from helpers.runs import ROOT, make_data, tiny_argv

FLAGS = ["--prompt", "def f(", "--prompt", "import", "--max-new-tokens", "6", "--greedy"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A --save folder of a 3-step pretrain run (byte-level tokenizer), and its eval-only log."""
    root = tmp_path_factory.mktemp("run")
    data = make_data(root)
    save = root / "ck"
    run_training(tiny_argv(data, "--save", str(save), "--train-iters", "3",
                           "--generate-tokens", "0"))
    lines = []
    run_training(tiny_argv(data, "--load", str(save), "--eval-only"), print_fn=lines.append)
    return save, lines


def run_main(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_save_folder_and_iter_folder_generate_the_api_text(trained, capsys):
    save, _ = trained
    expected = megazoo.generate(str(save), ["def f(", "import"], 6, greedy=True)
    assert all(text != p for text, p in zip(expected, ["def f(", "import"]))  # tokens added
    for load in (save, save / "iter_0000003"):
        code, out, err = run_main(["--load", str(load), *FLAGS], capsys)
        assert code == 0, err
        assert out == f"\n{SEPARATOR}\n".join(expected) + "\n"
        assert "generated" in err and "iter_0000003" in err


def test_eval_only_points_to_the_generate_command(trained):
    save, lines = trained
    assert any(line.startswith(f"to generate text from this checkpoint: python generate.py "
                               f"--load {save} --prompt") for line in lines), lines


def _cli_at_layouts(load: str) -> list[str]:
    outs = []
    for layout in (["--tp", "2"], ["--pp", "2"]):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert main(["--load", load, *FLAGS, *layout]) == 0
        outs.append(buffer.getvalue())
    return outs


def test_cli_at_tp2_and_pp2_prints_the_one_process_text(trained, capsys):
    save, _ = trained
    _, single, _ = run_main(["--load", str(save), *FLAGS], capsys)
    rank0, rank1 = run_distributed(_cli_at_layouts, 2, str(save), timeout=240)
    assert rank0 == [single, single] and rank1 == ["", ""]


def hf_tokenizer_json(path: Path) -> None:
    """A byte-level BPE tokenizer.json trained on a few lines (< 300 ids), with </s> and a
    template that starts every text with <s>, as LLaMA's does."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "def main(): return 0"] * 20, trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path))


def test_hf_tokenizer_next_to_the_checkpoint_and_missing_tokenizer(tmp_path, capsys):
    model = build_model(ModelConfig(family="llama", num_layers=2, hidden_size=32,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=300, max_position_embeddings=64), None,
                        device="cpu", seed=1)
    megazoo.save_checkpoint(model, tmp_path / "mz")
    flags = ["--load", str(tmp_path / "mz"), "--prompt", "hello", "--max-new-tokens", "3"]
    code, out, err = run_main(flags, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: no tokenizer found for") and "--tokenizer" in err
    code, out, _ = run_main(flags + ["--tokenizer", "bytes"], capsys)
    assert code == 0 and out.startswith("hello")
    hf_tokenizer_json(tmp_path / "mz" / "tokenizer.json")
    code, out, err = run_main(flags + ["--greedy"], capsys)
    assert code == 0 and out.startswith("hello"), err  # printed without the <s> it was fed
    tok = find_tokenizer(str(tmp_path / "mz"))
    assert encode_prompt(tok, "hello")[0] == 0 and tok.encode("hello")[0] != 0  # <s> is id 0


@pytest.mark.parametrize("extra, message", [
    (["--prompt", ""], "prompt 1 is empty"),
    ([], "no prompt given"),
    (["--prompt", "x", "--max-new-tokens", "500"], "exceeds the model's 64 positions"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "x", "--temperature", "0"], "--temperature must be > 0"),
    (["--prompt", "x", "--top-p", "2"], "--top-p must be in (0, 1]"),
    (["--prompt", "x", "--tokenizer", "nowhere.json"], "--tokenizer nowhere.json: not found"),
    (["--prompt", "x", "--prompt-file", "nowhere.txt"], "--prompt-file nowhere.txt: no such"),
    (["--prompt", "x", "--dtype", "float8"], "float8"),
    (["--prompt", "x", "--dtype", "int8"], "'int8' is not a floating-point type"),
    (["--prompt", "x", "--prompt-file", "."], "--prompt-file . is a folder"),
    (["--prompt", "x", "--pp", "3"], "--pp 3 exceeds the model's 2 layers"),
] + ([] if torch.accelerator.is_available() else [
    (["--prompt", "x", "--cuda-graphs"], "--cuda-graphs needs a CUDA device")]))
def test_bad_input_is_one_line_exit_2(trained, capsys, extra, message):
    save, _ = trained
    code, out, err = run_main(["--load", str(save), *extra], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_a_checkpoint_of_integer_weights_is_one_line(trained, tmp_path, capsys):
    import json
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(trained[0] / "iter_0000003", ck)
    meta = json.loads((ck / "megazoo.json").read_text())
    (ck / "megazoo.json").write_text(json.dumps({**meta, "dtype": "int8"}))
    code, out, err = run_main(["--load", str(ck), "--prompt", "x"], capsys)
    assert code == 2 and err.count("\n") == 1 and "holds int8 weights" in err, err


def test_a_tiny_temperature_is_the_greedy_limit(trained, capsys):
    save, _ = trained
    flags = ["--load", str(save), "--prompt", "def f(", "--max-new-tokens", "4"]
    code, greedy, err = run_main(flags + ["--greedy"], capsys)
    assert code == 0, err
    code, cold, err = run_main(flags + ["--temperature", "1e-38"], capsys)
    assert code == 0 and cold == greedy, err


def test_prompt_file_reads_stdin_devices_and_drops_a_bom(trained, tmp_path, capsys,
                                                         monkeypatch):
    save, _ = trained
    flags = ["--load", str(save), "--max-new-tokens", "2", "--greedy"]
    code, plain, err = run_main(flags + ["--prompt", "def f("], capsys)
    assert code == 0, err
    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffdef f(\n".encode("utf-8"))
    code, out, err = run_main(flags + ["--prompt-file", str(bom)], capsys)
    assert code == 0 and out == plain, err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def f(\n")))
    code, out, err = run_main(flags + ["--prompt-file", "-"], capsys)
    assert code == 0 and out == plain, err
    code, out, err = run_main(flags + ["--prompt-file", "/dev/null"], capsys)
    assert code == 2 and "no prompt given" in err, err  # read (empty), not "no such file"


def test_bad_load_folder(tmp_path, capsys):
    code, out, err = run_main(["--load", str(tmp_path / "none"), "--prompt", "x"], capsys)
    assert code == 2 and err == f"error: --load {tmp_path / 'none'}: no such folder\n"
    code, out, err = run_main(["--load", str(tmp_path), "--prompt", "x"], capsys)
    assert code == 2 and "is not a megazoo checkpoint" in err and "pass a --save folder" in err


def test_script_runs(trained):
    save, _ = trained
    proc = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--load", str(save),
                           "--prompt", "def", "--max-new-tokens", "4", "--greedy"],
                          capture_output=True, text=True, timeout=120, cwd=save.parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def")


def test_recorded_sentencepiece_model_found_from_another_folder(tmp_path, capsys, monkeypatch):
    """The default run records its tokenizer relative to where it ran ("data_cache/..."):
    found from another working folder through the folder holding the --save folder."""
    from megazoo.data.tokenizer import train_sentencepiece

    run = tmp_path / "run"
    (run / "data_cache").mkdir(parents=True)
    corpus = run / "data_cache" / "text.txt"
    corpus.write_text("def main():\n    return value\nimport os\n" * 50)
    monkeypatch.chdir(run)
    with capsys.disabled():  # sentencepiece writes to the real stdout's file descriptor
        train_sentencepiece([corpus], 60, "data_cache/tok")
    model = build_model(ModelConfig(family="gpt", num_layers=2, hidden_size=32,
                                    num_attention_heads=4, vocab_size=64,
                                    max_position_embeddings=64), None, device="cpu", seed=1)
    data = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "data_cache/tok.model"}
    megazoo.save_checkpoint(model, run / "ck" / "iter_0000001", extra={"args": {"data": data}})
    (run / "ck" / "latest").write_text("1")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["--load", "run/ck", "--prompt", "def main", "--max-new-tokens",
                               "4", "--greedy"], capsys)
    assert code == 0 and out.startswith("def main"), err
    (run / "data_cache" / "tok.model").unlink()
    code, out, err = run_main(["--load", "run/ck", "--prompt", "x"], capsys)
    assert code == 2 and "data_cache/tok.model, recorded in" in err and "--tokenizer" in err
