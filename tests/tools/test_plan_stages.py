"""The memory plan per pipeline stage and its picture (`python -m megazoo.plan ... --out`)."""
import sys

import pytest

from megazoo.config.flags import args_from_namespace
from megazoo.plan import main
from megazoo.plan.cli import plan_parser
from megazoo.plan.layout import resolve
from megazoo.plan.memory import _estimate, stage_parameters
from megazoo.plan.stages import stage_estimates

LAYOUT = ["--model", "gpt-1.3b", "--tp", "2", "--dp", "2", "--micro-batch-size", "2",
          "--global-batch-size", "32", "--seq-length", "2048", "--bf16"]


def _plan(*extra):
    args = args_from_namespace(plan_parser().parse_args([*LAYOUT, *extra]))
    layout = resolve(args)
    return args.model, layout, stage_estimates(args.model, layout), _estimate(args.model, layout)


def test_one_f_one_b_stages_and_the_report_agree():
    config, layout, stages, report = _plan("--pp", "4")
    assert len(stages) == 4
    assert max(s.gpu_total for s in stages) == pytest.approx(report.gpu_total, rel=1e-12)
    counts = stage_parameters(config, 2, 4)
    middle = config.num_layers // 4 * counts["block"]
    assert [s.parameters_per_gpu for s in stages] == \
        [counts["first"], middle, middle, counts["last"]]
    acts = [s.activations for s in stages]
    # stage r holds min(pp - r, m) = 4, 3, 2, 1 micro-batches; the last adds head and logits
    assert acts[0] > acts[1] > acts[2] and acts[1] - acts[2] == pytest.approx(acts[0] - acts[1])


def test_no_pipeline_is_one_stage_equal_to_the_report():
    _, _, stages, report = _plan()
    assert len(stages) == 1 and stages[0] == report


def test_interleaved_first_stage_matches_the_report_and_holds_more():
    _, _, one, _ = _plan("--pp", "4")
    _, _, two, report = _plan("--pp", "4", "--num-layers-per-virtual-pipeline-stage", "3")
    assert two[0].activations == pytest.approx(report.activations, rel=1e-12)
    assert two[0].activations > one[0].activations  # 1 + (pp - 1) / (pp vpp) times more


def test_out_draws_a_bar_per_stage(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert main([*LAYOUT, "--pp", "4", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {out}: one bar per pipeline stage; stage 0 is the most loaded at" in \
        capsys.readouterr().out


def test_out_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert main([*LAYOUT, "--out", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err == ('error: the memory plan picture needs matplotlib: pip '
                                       'install -e ".[plot]" (or pip install matplotlib)\n')
