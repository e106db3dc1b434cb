"""Anthropic's Messages API (``/v1/messages``) over the same engine, template and tool parsing as
the OpenAI routes: ``protocol.py`` (request and translation), ``serving_messages.py`` (answers and
events), ``routes.py`` (the routes and their errors, in Anthropic's shape)."""
