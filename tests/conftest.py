"""Suite-wide settings. Tiny models are dominated by thread start-up: with pytest-xdist running
one worker per core, one torch thread per worker is fastest (10-70x under load)."""

import torch

torch.set_num_threads(1)
