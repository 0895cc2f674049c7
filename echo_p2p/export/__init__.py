"""Export: a trained policy as a Hugging Face model directory that transformers and vLLM load.

``python -m echo_p2p.export`` (``__main__``) writes ``config.json``, ``generation_config.json``, the tokenizer
files and ``model.safetensors`` (plus ``echo_p2p_export.json``: where the weights came from) from either

- a trainer checkpoint (``checkpoint``): the trainer's fp32 master weights, verified against ``meta.json``;
  the model's description comes from the checkpoint itself (``policy_files``: trainers attach their config
  and tokenizer files) or, for older checkpoints, from ``--model``; or
- a live run (``live``): the newest policy version of the run's trusted trainers, fetched through the swarm
  by the same ``WeightFetcher`` and trust rules an inference peer uses (signed manifest chain, trainers from
  the owner's run record or a trusted-trainers file).

Both end in ``model_dir.write_model_dir`` (cast to the chosen dtype, refuse non-finite values, write into a
temporary directory and rename). Settings and errors are ``config``. Importing this package is cheap: the
modules import torch, transformers and hivemind inside their functions.
"""
