"""OpenAI-compatible HTTP serving of many LoRA adapters on one base model: ``python -m slora_jax.serve``.

See docs/SERVING.md. Modules: ``cli`` (flags, start-up) -> ``server`` (engine + app + uvicorn) -> ``app`` (the
routes) over ``request_builder`` (body -> prompt ids, adapter, sampling), ``generation`` (one request's answer, JSON
or SSE), ``adapters`` (validate-then-register, runtime load rules), ``engine_loop`` (the only code that steps the
engine), run by ``engine_thread`` in this process or, with ``--engine-process``, by ``engine_process`` in a child
that ``engine_client`` drives over ``engine_wire``; with ``protocol`` (bodies), ``errors``, ``gate`` (auth, drain
refusal, request counting), ``limits`` (body size, header and body deadlines), ``shutdown`` (the graceful drain),
``metrics``, ``config``, ``demo``.
"""
