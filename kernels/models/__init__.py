"""Reference model functions (the numerical contract): per-layer code both the learner and vLLM run.

``qwen3_dsv3``: Qwen3-MoE and DeepSeek-V3 (MLA); ``dsv4``: DeepSeek-V4; ``trace``: the localiser's
activation taps. Built only from ``kernels`` ops and torch (transformers / safetensors for configs and
files); never vLLM, never Megatron.
"""
