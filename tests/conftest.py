"""Test-wide settings: deterministic CPU math, quiet third-party warnings."""

import os
import warnings

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*absl.logging.*")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
