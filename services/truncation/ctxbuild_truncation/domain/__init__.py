"""Pure logic of the in-flight lane: no I/O, unit-tested. The trimming itself is ctxbuild_codec's."""

from .step import PutResult, StepPlan, StepResult, apply_step, plan_step, written_from

__all__ = ["PutResult", "StepPlan", "StepResult", "apply_step", "plan_step", "written_from"]
