"""Built-in models: `builtin://NAME` model paths, made offline on first use and cached."""
