"""GPT / BLOOM / LLaMA with context parallelism (alone, with Ulysses, tp + Megatron SP, dp)
on 4 gloo ranks against one process (cp_model_checks.py)."""
from helpers import cp_model_checks
from megazoo.testing import run_distributed


def test_context_parallel_layouts_match_single_process():
    results = run_distributed(cp_model_checks.check_cp_families, 4, timeout=300)
    for errors in results:
        assert errors == []
