import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the kernels' widths as the constants say, not as a load measures them (`engine.kernels.crossover`):
# the same path for the same step on every run; test_crossover.py measures
os.environ.setdefault("ACTORSERVE_CROSSOVER", "static")
