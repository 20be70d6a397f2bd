"""vLLM general plugin entry point (runs in the main, engine-core and worker processes)."""


def register() -> None:
    from vllm_bridge import vllm_patches

    vllm_patches.apply()
