"""The controller side: rollout scheduling, the staleness-bounded buffer, and workflows. Never imports torch."""
