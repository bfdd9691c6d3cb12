"""Model families: one package per architecture (``deepseek_v4/``, ``deepseek_v41/``), what they share
(``common/``), and the registry that maps a checkpoint's ``model_type`` to its family."""
