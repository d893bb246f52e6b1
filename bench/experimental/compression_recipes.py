"""Research recipes of gradient compression: the internals (`compression_config.INTERNALS`:
momentum share, topk selection, local clipping) in combinations that no named recipe ships,
for `bench/compression_convergence.py` to compare with the named ones. Runs `pretrain_gpt.py`
with these recipes known as well:

    torchrun --nproc-per-node 2 bench/experimental/compression_recipes.py \
        --compression-recipe topk-fv-update [pretrain_gpt.py flags]

What they showed on the default run (topk-tuned came out of them) is in
bench/results/compression_momentum_cpu_2026-11-23.md and
compression_momentum_share_cpu_2026-11-24.md.
"""
import sys

TOPK_FV = {"gradient_compression": "topk", "topk_ratio": 0.01, "compression_start_step": 100,
           "freeze_variance": True}
RESEARCH = {
    # entries chosen by the size of their AdamW step, not of their momentum
    "topk-fv-update": {**TOPK_FV, "topk_selection": "update"},
    # each rank clipping its own gradient before compression (DGC's local clipping)
    "topk-fv-lclip": {**TOPK_FV, "local_clipping": True},
    "topk-fv-update-lclip": {**TOPK_FV, "topk_selection": "update", "local_clipping": True},
    # topk-tuned's internals at share s of the momentum carried through the compression
    **{f"topk-tuned-share{s}": {**TOPK_FV, "compression_start_step": 300,
                                 "topk_selection": "update", "local_clipping": True,
                                 "momentum_share": s} for s in (0.0, 0.1, 0.3, 0.5, 1.0)},
}


def main() -> int:
    from megazoo.training.compression_config import RECIPES

    RECIPES.update(RESEARCH)  # before the flags are built, so that argparse knows them
    from megazoo.cli import pretrain

    return pretrain()


if __name__ == "__main__":
    sys.exit(main())
