import os

import rlcourse  # noqa: F401,E402  before anything imports torch: it sets how OpenMP threads wait
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
