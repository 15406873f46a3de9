"""tau-bench retail and airline environments: data, tools, tasks, episodes, replay.

Beside them: :mod:`.tau2` (tau2-bench, built on these databases, calculator and gold
helpers) and the glue of a tau or tau2 run, :mod:`.data` (its tasks, domain and users)
and :mod:`.episodes` (its rollout and reward hooks).

Typical use::

    from turnrl.tool_envs.tau import TauDomain, TauEnv, load_tasks

    domain = TauDomain.from_dir("retail", "path/to/tau-bench/retail")
    tasks = load_tasks("path/to/tau-bench/retail/tasks_train.jsonl")
    env = TauEnv(domain, user=my_user_simulator, tasks=tasks)
    messages = await env.reset(0)            # [system policy, user's first message]
    result = await env.step(assistant_turn)  # tool results and/or the user's reply
"""

from turnrl.tool_envs.tau.calculate import calculate
from turnrl.tool_envs.tau.db import (
    Database,
    DataError,
    PristineData,
    reference_data_hash,
    to_hashable,
)
from turnrl.tool_envs.tau.domain import Replay, TauDomain
from turnrl.tool_envs.tau.env import STOP_MARKER, TauEnv, TauEnvConfig
from turnrl.tool_envs.tau.tasks import (
    Action,
    Task,
    TaskFormatError,
    load_tasks,
    load_tasks_jsonl,
    load_tasks_py,
)

__all__ = [
    "STOP_MARKER",
    "Action",
    "DataError",
    "Database",
    "PristineData",
    "Replay",
    "Task",
    "TaskFormatError",
    "TauDomain",
    "TauEnv",
    "TauEnvConfig",
    "calculate",
    "load_tasks",
    "load_tasks_jsonl",
    "load_tasks_py",
    "reference_data_hash",
    "to_hashable",
]
