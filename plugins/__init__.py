"""hookfit's built-in plugins.

Each is registered in the ``hookfit`` entry-point group in ``pyproject.toml``, exactly like a
third-party plugin, and the core never imports one by name.
"""
