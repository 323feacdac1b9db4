"""What a run says: the recorder's arrays (``recorder``), metrics with ``vllm bench
serve`` names (``metrics``), KV memory figures (``kv``), console tables and result files
(``output``), plots (``plots``, ``plotkit``) and notebook helpers (``notebook``)."""
