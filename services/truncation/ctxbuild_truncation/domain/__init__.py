"""Pure logic of the in-flight lane: no I/O, unit-tested."""

from .policy import ToolPolicy, policy_for, tool_name_of
from .step import PutResult, StepResult, TrimJob, apply_step, extract_text, plan_step

__all__ = ["PutResult", "StepResult", "ToolPolicy", "TrimJob", "apply_step", "extract_text", "plan_step",
           "policy_for", "tool_name_of"]
