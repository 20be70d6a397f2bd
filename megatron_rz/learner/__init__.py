"""The learner: Megatron-Core models (ModuleSpec, aligned layers), HF load/export, optimizer, distributed checkpoints."""
