"""KV-cache memory: block arithmetic (``blocks``), who holds which block and which
blocks hold a known prefix (``manager``), the rules for admitting, growing and
preempting (``space``), and the names of blocks' contents (``prefixkeys``)."""
