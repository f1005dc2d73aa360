"""The trainer config: composing it from the YAML and overrides (`loader`), the names and checks
that need no worker code (`checks`), which keys each role reads (`keys`), and which keys take effect
in a given config (`key_status`). Lowest layer after `protocol`/`seqpack`: imports no other rlframe code.
"""
