"""The agent gateway: an OpenAI/Anthropic-compatible endpoint in front of the engines.

Any agent program points its base URL here; per session, :mod:`.ledger` keeps the exact
token ids of every conversation chain (the engine's sampled ids, never re-tokenised text),
and the episode leaves as the same token-exact record as every other rollout.
"""
