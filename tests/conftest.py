import os

# Tests never write to the user's cache.
os.environ.setdefault("RESJAX_CACHE", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "resjax"))
