"""The XLA suite's transformers 5 half: run by ``bash scripts/test_xla.sh`` after tests_xla/, in the
same torch 2.9 + torch-xla 2.9 venv with the transformers 5.24 overlay first on PYTHONPATH
(scripts/setup_xla.sh: tests_xla/ keeps transformers 4.57, the 4.x line NxD's trn1 models use,
and the mixture-of-experts recompute modules need 5.x: 3-D experts, ``set_experts_implementation``).

transformers older than 5 here is a broken setup, not a reason to skip: collection fails, so
these tests can never pass by skipping themselves. Without torch-xla (the main torch 2.13
environment) nothing here is collected, as in tests_xla/.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("torch_xla") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise pytest.UsageError(
            f"tests_xla_hf5 needs transformers 5 (got {transformers.__version__} from {transformers.__file__}); "
            "run it through `bash scripts/test_xla.sh`, which puts the overlay from scripts/setup_xla.sh first on "
            "PYTHONPATH"
        )
    from tests_xla.conftest import xla  # noqa: F401  (the same fixture: init_distributed on XLA, TP 1)


def pytest_report_header(config):
    if importlib.util.find_spec("torch_xla") is None:
        return None
    import torch
    import transformers

    return (
        f"tests_xla_hf5: torch {torch.__version__}, transformers {transformers.__version__} ({transformers.__file__})"
    )
