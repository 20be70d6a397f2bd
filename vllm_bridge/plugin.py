"""vLLM general plugin entry point (runs in the main, engine-core and worker processes).

Declared in pyproject.toml: [project.entry-points."vllm.general_plugins"]
reinforce_zero = "vllm_bridge.plugin:register". vLLM calls register() in every process it starts,
before any model is built, so the bug fixes in vllm_bridge.vllm_patches are active in the workers
where weights are (re)loaded. Must stay light and never import megatron.
"""


def register() -> None:
    from vllm_bridge import sampler_patch, vllm_patches

    vllm_patches.apply()
    sampler_patch.apply()  # aligned engines' sampler: the kernels.sampling contract
    sampler_patch.apply_v2()  # the same on vLLM's V2 GPU model runner (CUDA 0.26; opt-in per engine)
    __import__("vllm_bridge.aligned", fromlist=["register_aligned"]).register_aligned()
