"""The fleetwire worker agent: dials the coordinator and runs plans through handlers."""

from worker_agent.agent import Agent, AuthError
from worker_agent.handlers import Context, HandlerError, load_handler_spec
from worker_agent.settings import AgentSettings

__all__ = ["Agent", "AgentSettings", "AuthError", "Context", "HandlerError", "load_handler_spec"]
