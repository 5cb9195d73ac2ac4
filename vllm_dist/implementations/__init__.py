"""Built-in backends. Loaded lazily through ``vllm_dist.registry``; never imported by tasks."""
