"""What users touch: ``VLLM``, its tracer and envoys."""
