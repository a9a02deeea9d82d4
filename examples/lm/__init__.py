"""The training example's byte-level language model (``python -m examples.train_lm``), as a library.

- ``data``: the corpus (the standard library's source as bytes), its token windows and the batches of a run;
- ``mesh``: the device mesh, the logical-axis rules that shard the model on it, sharded parameters;
- ``model``: the transformer, the NVFP4 recipes it trains with (``RECIPES``), its loss and ``build_model``;
- ``training``: the training loop with its evaluation, and saving a trained model for inference;
- ``report``: the results' tables and plots.
"""
