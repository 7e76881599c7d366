"""Pure logic of the in-flight lane: no I/O, unit-tested. The trimming itself is ctxbuild_codec's."""

from .claims import Claim, ClaimMeter, Measured, claim_plan, measured_cut, parse_claims
from .step import PutResult, StepPlan, StepResult, apply_step, plan_step, written_from

__all__ = ["Claim", "ClaimMeter", "Measured", "PutResult", "StepPlan", "StepResult", "apply_step", "claim_plan",
           "measured_cut", "parse_claims", "plan_step", "written_from"]
