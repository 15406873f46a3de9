"""ReTool: math problems solved with a ``code_interpreter`` tool backed by the code sandbox.

- :mod:`.env`: ``RetoolEnv``, one problem, the tool, an answer in ``\\boxed{}``.
- :mod:`.episodes`: its episodes against a token engine, scored with ReTool's reward.
- :mod:`.data`: ReTool-SFT, DAPO-Math-17k and AIME loaders from local files.
- :mod:`.synth`: generated arithmetic problems and their ReTool-style SFT chats.
- :mod:`.dapo`: DAPO on scored episodes (overlong shaping, the dynamic filter's values).
"""
