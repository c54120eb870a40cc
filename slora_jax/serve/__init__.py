"""OpenAI-compatible HTTP serving of many LoRA adapters on one base model: ``python -m slora_jax.serve``.

See docs/SERVING.md. Modules: ``cli`` (flags, start-up) -> ``server`` (engine thread + app + uvicorn) -> ``app`` (the
routes) over ``request_builder`` (body -> prompt ids, adapter, sampling), ``generation`` (one request's answer, JSON
or SSE), ``adapters`` (validate-then-register, runtime load rules), ``engine_thread`` (the only code that steps the
engine), with ``protocol`` (bodies), ``errors``, ``gate`` (auth, drain refusal, request counting), ``limits`` (body
size, header and body deadlines), ``shutdown`` (the graceful drain), ``metrics``, ``config``, ``demo``.
"""
