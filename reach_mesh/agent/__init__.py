"""The agent SDK: ``Agent``, the ``Task`` a handler receives, and ``run`` for entry points."""

from __future__ import annotations

from reach_mesh.agent._agent import Agent, AgentStatus
from reach_mesh.agent._run import run
from reach_mesh.agent._task import Task, TaskFailed

__all__ = ["Agent", "AgentStatus", "Task", "TaskFailed", "run"]
