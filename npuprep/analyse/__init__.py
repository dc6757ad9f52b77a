"""Findings: where a model will leave the target's range, from static rules and measured stats."""
