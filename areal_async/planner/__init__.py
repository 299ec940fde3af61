"""The capacity planner: the real schedule (controller, rollout manager, staleness buffer) run in virtual time
against simulated inference servers and trainers, to predict a run before it is launched (docs/planner.md)."""
