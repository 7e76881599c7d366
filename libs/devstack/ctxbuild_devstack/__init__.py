from .stack import INFRA, SERVICES, Stack, StackError, free_port

__all__ = ["INFRA", "SERVICES", "Stack", "StackError", "free_port"]
