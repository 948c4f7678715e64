"""Serving over HTTP, as vLLM's ``vllm.entrypoints``: the asynchronous engine front (``async_llm``), the
OpenAI-compatible server (``openai_server``), its request models (``protocol``), the endpoints' work
(``serving``) and its Prometheus metrics (``metrics``). Needs the ``serve`` extra (FastAPI, uvicorn,
prometheus-client)."""
