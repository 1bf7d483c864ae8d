"""Kernel tests: without a CUDA device, Triton kernels run in Triton's CPU interpreter.

``TRITON_INTERPRET`` must be set before Triton is first imported; pytest loads this file
before it collects (imports) any test module of this folder. An explicit setting wins.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
