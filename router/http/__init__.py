"""The OpenAI-compatible HTTP front end: a second thin adapter over ``Router.generate``.

``schemas.py`` (pydantic bodies), ``convert.py`` (OpenAI request -> ``GenerateRequest``,
events -> choices), ``errors.py`` (``RouterError`` -> OpenAI's error shape and status),
``chat_template.py`` (sandboxed Jinja2), ``streams.py`` (n choices merged, SSE,
disconnect), ``app.py`` (FastAPI routes), ``server.py`` (uvicorn in the router's loop).
"""
