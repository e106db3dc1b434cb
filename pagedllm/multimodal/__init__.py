"""Image inputs: loading (``media.py``), hashing (``hasher.py``), the family's processor run on a prompt
(``processor.py``), the processed form that travels to the engine (``inputs.py``) and the encoder
cache (``encoder_cache.py``). A family's vision tower itself lives in ``models/<family>_vision.py``."""
