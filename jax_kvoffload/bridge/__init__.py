"""Adapters to torch and vLLM. Importing this package imports neither torch nor vLLM."""
