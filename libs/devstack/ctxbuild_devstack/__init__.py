from .stack import INFRA, SERVICES, Stack, StackError, free_port, private_stack

__all__ = ["INFRA", "SERVICES", "Stack", "StackError", "free_port", "private_stack"]
