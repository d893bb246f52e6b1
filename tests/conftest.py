import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped on CPU-only machines)")
    config.addinivalue_line("markers", "slow: spawns training processes (runs in CI too; "
                                       "-m 'not slow' leaves them out locally)")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        needed = marker.kwargs.get("count", 1) if marker else 0
        if needed > gpus:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} GPU(s), found {gpus}"))
