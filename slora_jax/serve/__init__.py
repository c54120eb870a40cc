"""OpenAI-compatible HTTP serving of many LoRA adapters on one base model: ``python -m slora_jax.serve``.

See docs/SERVING.md. Modules: ``cli`` (flags) -> ``server`` (engine thread + app + uvicorn) -> ``app`` (endpoints)
over ``engine_thread`` (the only code that touches the engine), with ``protocol``, ``detok``, ``metrics``, ``demo``.
"""
