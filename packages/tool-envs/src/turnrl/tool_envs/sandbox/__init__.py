"""A SandboxFusion-compatible code sandbox: a contained, fast server and a client.

``turnrl-sandbox serve`` runs the server (:mod:`.server`, :mod:`.forkserver`); the
:class:`~turnrl.tool_envs.sandbox.client.SandboxClient` talks to it or to a real
SandboxFusion server.
"""

from turnrl.tool_envs.sandbox.client import RunResult, SandboxClient, SandboxClientConfig

__all__ = ["RunResult", "SandboxClient", "SandboxClientConfig"]
