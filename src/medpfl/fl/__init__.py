"""Federated core: engine, executors, schedules, evaluation protocol."""
