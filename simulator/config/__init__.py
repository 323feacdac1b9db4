"""The scenario: one typed configuration tree (``scenario``, with the wire's part in
``wire``), loaded from YAML, and the plug-in registries its ``kind:`` fields name
(``registry``)."""
