"""A live view of the block pool (``GET /dashboard``): the page, its snapshot stream, and the history
behind its charts. See ``routes.py`` for the endpoints and ``snapshot.py`` for what is sampled."""
