"""``hl.optim``: SGD, Adam, AdamW and the Trainer."""
from .optimizer import SGD, Adam, AdamW, Optimizer, create  # noqa: F401
from .trainer import Trainer  # noqa: F401
from .clip import clip_global_norm  # noqa: F401
