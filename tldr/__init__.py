"""The TL;DR demo's helpers and data, beside train_tldr.py: its memory model (memory.py), its offline
SmolLM2 (offline.py) and its embedded posts (posts.jsonl)."""
