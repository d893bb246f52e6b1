"""Pipeline parallelism: schedules as pure data, a simulator, an executor, and
``forward(model, ids, state, labels=None)``: ids through every stage (logits or loss on the
last stage, None elsewhere, or on every rank with ``broadcast=True``).

``build_schedule(pp, vpp, m)`` returns one action list per rank; ``simulate`` runs it in
simulated time (deadlock check, bubble, activation memory); ``python -m
megazoo.pipeline.show`` draws a timeline.
"""

from .forward_only import forward
from .schedules import (Action, ActionKind, build_schedule, interleaved_schedule,
                        no_pipeline_schedule, one_f_one_b_schedule, virtual_stage)
from .simulate import PipelineDeadlockError, SimulationResult, TimelineEntry, simulate

__all__ = ["Action", "ActionKind", "PipelineDeadlockError", "SimulationResult", "TimelineEntry",
           "build_schedule", "forward", "interleaved_schedule", "no_pipeline_schedule",
           "one_f_one_b_schedule", "simulate", "virtual_stage"]
