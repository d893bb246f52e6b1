"""Code the tests share, imported as ``from helpers.<module> import ...`` (tests/conftest.py
puts tests/ on the path; spawned ranks inherit it).

* ``fixtures``: the tiny model configurations;
* ``*_checks``: the rank-side code of the multi-rank tests, one module per topic;
* ``runs``: tiny byte-level data and the pretrain_gpt.py flags of a tiny run;
* ``checkpoints``: a tiny model to save, byte-level corruption of a saved checkpoint, and the
  refused-command check of the converters;
* ``hf_models``: tiny random Hugging Face models (the converters' reference);
* ``run_args``: the run's PretrainArgs for a planner layout or a DeepSpeed config.

Test modules import from here, never from one another.
"""
