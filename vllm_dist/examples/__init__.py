"""Examples built on the public API: what an engine or a trainer writes, and the CLI's demos.

``llama_tp`` holds the tensor-parallel loaders and the Llama layout an inference engine keeps;
``weight_sync_demo`` is the verified weight sync that ``vllm-dist run weight-transfer`` runs.
They sit outside ``tasks`` because they pick a launcher and a model: tasks never import them.
"""
