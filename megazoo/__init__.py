"""megazoo: a Megatron-style model zoo."""
