"""The step-time model's prediction for a planner command line (tests/tools/test_plan_*)."""
from __future__ import annotations

import dataclasses

from megazoo.plan.cli import plan_parser
from megazoo.plan.clusters import load_cluster
from megazoo.plan.layout import resolve
from megazoo.plan.published import plan_args
from megazoo.plan.timing import step_time


def predict(flags: str, cluster, vocab: int | None = None):
    """`step_time` of the planner flags `flags` on `cluster` (a name, or a `Cluster`;
    `vocab`: the model's vocabulary instead of the flags')."""
    args, config, _ = plan_args(plan_parser().parse_args(flags.split()))
    if vocab is not None:
        config = dataclasses.replace(config, vocab_size=vocab)
    cluster = load_cluster(cluster) if isinstance(cluster, str) else cluster
    return step_time(args, resolve(args), cluster, config)
