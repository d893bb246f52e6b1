"""Hugging Face converters, with `transformers` as the reference implementation.

Tiny random HF models (GPT2LMHeadModel, BloomForCausalLM, LlamaForCausalLM with GQA 4 heads /
2 kv heads; hidden 64, 2 layers, vocab 300: not a multiple of 128, so padding is added and
removed) are saved by `save_pretrained` (safetensors; llama sharded with an index), converted
at (tp, pp) in (1,1) (2,1) (1,2) (2,2), and run on 4 gloo ranks.

Tolerance for logits: fp32, max |megazoo - HF| <= 1e-5 * max |HF|. Both compute the same
function with other kernels and summation orders (SDPA vs math attention, one fused QKV matmul
vs three, ALiBi as -slope*|i-j| vs slope*j (equal up to a per-row constant), tp partial
sums): differences are float32 rounding (~1e-7 relative per op) over two layers, 100x below
the bound, while a misplaced row or transpose gives O(1) errors. Conversions themselves only
copy, transpose and permute, so round trips are compared with torch.equal.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import megazoo
from megazoo.checkpoint import CheckpointReader, save_checkpoint, write_checkpoint
from megazoo.convert import hf_to_megazoo, megazoo_to_hf, reshard
from megazoo.convert.cli import hf_to_megazoo_main, megazoo_to_hf_main, reshard_main
from megazoo.models import ModelConfig, build_model
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.pipeline.executor import run_pipeline
from megazoo.testing import run_distributed
from helpers.fixtures import tiny_config
from helpers.hf_models import VOCAB, hf, hf_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B, S, RTOL = 2, 8, 1e-5
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
FAMILIES = ("gpt2", "bloom", "llama")


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(11))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_tensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors files (single or sharded)."""
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def check_layouts(root: str, expected: dict) -> list[str]:
    """Rank side: load each family's conversion at each layout; compare logits with HF's."""
    errors = []
    for tp, pp in LAYOUTS:
        state = ParallelState.initialize(ParallelConfig(tp=tp, pp=pp))
        for kind in FAMILIES:
            model = megazoo.load_pretrained(os.path.join(root, f"{kind}-tp{tp}-pp{pp}"), state=state)
            with torch.no_grad():
                if pp == 1:
                    logits = model(ids())
                else:
                    out = run_pipeline(model, [(ids(), None)] * pp, state, forward_only=True)
                    logits = None if out is None else out[0]
            if logits is not None and not rel_err(logits, expected[kind]) <= RTOL:
                errors.append(f"{kind} tp{tp} pp{pp}: rel err {rel_err(logits, expected[kind]):.2e}")
    return errors


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    logits = {}
    for kind in FAMILIES:
        model = hf_model(kind)
        shard = dict(max_shard_size="40KB") if kind == "llama" else {}  # exercise the index
        model.save_pretrained(os.path.join(root, kind), **shard)
        with torch.no_grad():
            logits[kind] = model(ids()).logits
    return root, logits


def test_hf_logits_at_every_layout(hf_dirs):
    """HF -> megazoo at (tp, pp) in LAYOUTS; megazoo logits on 4 gloo ranks == HF's (RTOL)."""
    root, logits = hf_dirs
    assert "model.safetensors.index.json" in os.listdir(os.path.join(root, "llama"))
    for kind in FAMILIES:
        for tp, pp in LAYOUTS:
            hf_to_megazoo(os.path.join(root, kind), os.path.join(root, f"{kind}-tp{tp}-pp{pp}"),
                          tp=tp, pp=pp)
    results = run_distributed(check_layouts, 4, root, logits, timeout=240)
    errors = sorted({e for r in results for e in r})
    assert errors == [], "\n".join(errors)


@pytest.mark.parametrize("kind", FAMILIES)
def test_hf_megazoo_hf_is_bit_exact_and_generates(hf_dirs, tmp_path, kind):
    root, logits = hf_dirs
    hf_to_megazoo(os.path.join(root, kind), tmp_path / "mz", tp=2, pp=2)
    megazoo_to_hf(tmp_path / "mz", tmp_path / "hf", max_shard_bytes=64 * 1024)
    before, after = hf_tensors(os.path.join(root, kind)), hf_tensors(str(tmp_path / "hf"))
    if kind != "llama":
        before.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    assert sorted(before) == sorted(after)
    for key, t in before.items():
        assert torch.equal(after[key], t), key
    model, info = hf().AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True)
    assert all(not v for v in info.values()), info
    with torch.no_grad():
        assert torch.equal(model.eval()(ids()).logits, logits[kind])
    out = model.generate(ids(), max_new_tokens=3, do_sample=False)
    assert out.shape == (B, S + 3)


def tiny(family: str) -> ModelConfig:
    return tiny_config(family, num_attention_heads=4, max_position_embeddings=32)


@pytest.mark.parametrize("family", ["gpt", "bloom", "llama"])
def test_megazoo_hf_megazoo_is_bit_exact(tmp_path, family):
    model = build_model(tiny(family), None, device="cpu", seed=5)
    save_checkpoint(model, tmp_path / "a")
    megazoo_to_hf(tmp_path / "a", tmp_path / "hf")
    hf_to_megazoo(tmp_path / "hf", tmp_path / "b", tp=2)
    a, b = CheckpointReader(tmp_path / "a"), CheckpointReader(tmp_path / "b")
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        assert torch.equal(a.full_tensor(name), b.full_tensor(name)), name


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_trained_checkpoint_gives_the_same_loss_in_hf(tmp_path, family):
    """A few SGD steps in megazoo, then HF's loss on the same tokens (RTOL, fp32)."""
    model = build_model(tiny(family), None, device="cpu", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(ids(), labels=ids()).backward()
        opt.step()
    with torch.no_grad():
        loss = model(ids(), labels=ids())
    save_checkpoint(model, tmp_path / "mz")
    megazoo_to_hf(tmp_path / "mz", tmp_path / "hf")
    converted = hf().AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        hf_loss = converted(ids(), labels=ids()).loss
    assert abs(hf_loss.item() - loss.item()) <= RTOL * loss.item()
    assert converted.generate(ids()[:1], max_new_tokens=2, do_sample=False).shape == (1, S + 2)


def test_reshard_any_layout_keeps_weights_and_aux(tmp_path):
    cfg = tiny("llama")
    ref = build_model(cfg, None, device="cpu", seed=0)
    full = {n: p.detach()[:VOCAB] if getattr(p, "tp_unpadded", None) else p.detach()
            for n, p in ref.named_parameters()}

    def fetch(key):
        prefix, _, name = key.rpartition("/")
        return full[name] * (3.0 if prefix else 1.0)

    write_checkpoint(cfg, tmp_path / "a", fetch, tp=2, pp=2, aux_prefixes=("exp_avg",))
    assert reshard_main(["--load", str(tmp_path / "a"), "--out", str(tmp_path / "b"),
                         "--tp", "1", "--pp", "2", "--vpp", "1"]) == 0
    with pytest.raises(ValueError, match="is or contains the input"):  # never in place
        reshard(tmp_path / "b", tmp_path / "b", tp=2, pp=1, overwrite=True)
    reshard(tmp_path / "b", tmp_path / "c", tp=2, pp=1)
    b = CheckpointReader(tmp_path / "c")
    assert b.layout == {"tp": 2, "pp": 1, "vpp": 1} and b.aux_prefixes == ("exp_avg",)
    for name, t in full.items():
        assert torch.equal(b.full_tensor(name), t), name
        assert torch.equal(b.full_tensor(name, "exp_avg"), t * 3.0), name


def _edit_config(directory, **changes):
    file = os.path.join(directory, "config.json")
    cfg = json.loads(open(file).read())
    cfg.update(changes)
    open(file, "w").write(json.dumps(cfg))


def _break(kind: str, src: str, dst: str) -> list[str]:
    """Copy `src` to `dst`, break it one way; return the extra CLI arguments."""
    shutil.copytree(src, dst)
    if kind == "model_type":
        _edit_config(dst, model_type="t5")
    elif kind == "contradiction":
        _edit_config(dst, intermediate_size=128)
    elif kind == "missing":
        os.remove(os.path.join(dst, sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))[0]))
    elif kind == "truncated":
        name = sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))[-1]
        data = open(os.path.join(dst, name), "rb").read()
        open(os.path.join(dst, name), "wb").write(data[: len(data) - 100])
    return ["--tp", "3"] if kind == "tp" else []


@pytest.mark.parametrize("kind, message", [
    ("model_type", "unsupported model_type 't5'"),
    ("contradiction", "config.json contradicts the weights"),
    ("missing", "HF shard .* is missing"),
    ("truncated", "HF shard .* is damaged or truncated"),
    ("tp", "num_heads \\(4\\) is not divisible by tp"),
])
def test_cli_errors_are_one_line_exit_2_no_output(hf_dirs, tmp_path, capsys, kind, message):
    root, _ = hf_dirs
    args = _break(kind, os.path.join(root, "llama"), str(tmp_path / "hf"))
    out = tmp_path / "out"
    assert hf_to_megazoo_main(["--hf-dir", str(tmp_path / "hf"), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(message, err), err
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no output, no temp dir


def test_megazoo_to_hf_missing_shard_exit_2(tmp_path, capsys):
    model = build_model(tiny("gpt"), None, device="cpu")
    save_checkpoint(model, tmp_path / "mz")
    os.remove(tmp_path / "mz" / "model-pp000-tp000.safetensors")
    assert megazoo_to_hf_main(["--load", str(tmp_path / "mz"), "--out", str(tmp_path / "hf")]) == 2
    assert "model-pp000-tp000.safetensors is missing" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["mz"]


def test_script_runs_from_a_checkout(hf_dirs, tmp_path):
    """The real command line, the script run from another folder (megazoo importable as after
    `pip install -e .`); its error path is main() in test_cli_errors_are_one_line_exit_2_no_output."""
    root, _ = hf_dirs
    script = os.path.join(REPO, "checkpoints_tools", "hf_to_megazoo.py")
    ok = subprocess.run([sys.executable, script, "--hf-dir", os.path.join(root, "gpt2"),
                         "--out", str(tmp_path / "o"), "--tp", "2", "--dtype", "bf16"],
                        capture_output=True, text=True, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert CheckpointReader(tmp_path / "o").dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["int8", "int32", "uint8", "bool"])
def test_converters_refuse_non_floating_dtypes(tmp_path, capsys, dtype):
    """Weights cast to an integer dtype are zeros (and sign bits): refused, nothing written."""
    save_checkpoint(build_model(tiny("gpt"), None, device="cpu"), tmp_path / "mz")
    for main, argv in ((reshard_main, ["--load", str(tmp_path / "mz"), "--out"]),
                       (megazoo_to_hf_main, ["--load", str(tmp_path / "mz"), "--out"])):
        assert main([*argv, str(tmp_path / "out"), "--dtype", dtype]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"'{dtype}' is not a floating-point type" in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["mz"]
