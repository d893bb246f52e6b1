"""Where logged scalars go besides the log line and `--log-json`: TensorBoard and Weights &
Biases, each optional and imported only when its flag asks for it.

    writers = open_writers(logging_cfg, save_dir, run_config, print_fn)   # rank 0 only
    for w in writers: w.scalars({"loss": 3.1, "lr": 1e-3}, step=50)
    for w in writers: w.close()

A writer whose package is missing is not opened: one line names the flag it ignores and the
install command, and the run goes on. Weights & Biases runs offline (files only, no account,
no network) when `WANDB_MODE=offline` is set, and also when no API key is configured
(`WANDB_API_KEY` or `wandb login`): it says so and where the files are, for `wandb sync`.
"""
from __future__ import annotations

import netrc
import os
from urllib.parse import urlparse

INSTALL = 'pip install -e ".[test]"'


class TensorBoardWriter:
    """Scalars into a TensorBoard event file under `folder`."""

    def __init__(self, folder: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(folder)

    def scalars(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """Scalars into a Weights & Biases run (project, name and folder as Megatron names them)."""

    def __init__(self, project: str, name: str | None, folder: str, config: dict, print_fn):
        import wandb

        os.makedirs(folder, exist_ok=True)
        mode = None
        if not os.environ.get("WANDB_MODE") and not _wandb_key_configured():
            mode = "offline"
            print_fn(f"wandb: no API key (WANDB_API_KEY or `wandb login`): logging offline "
                     f"under {folder}; `wandb sync` uploads it later")
        self.run = wandb.init(project=project, name=name, dir=folder, config=config, mode=mode)

    def scalars(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_key_configured() -> bool:
    """An API key in the environment or in ~/.netrc for the wandb host (`wandb login`)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def open_writers(cfg, save_dir: str | None, run_config: dict, print_fn) -> list:
    """The writers `cfg` (LoggingConfig) asks for whose packages import; a line for the rest."""
    writers = []
    if cfg.tensorboard_dir:
        try:
            writers.append(TensorBoardWriter(cfg.tensorboard_dir))
        except ImportError:
            print_fn(f"tensorboard is not installed: --tensorboard-dir ignored "
                     f"(pip install tensorboard, or {INSTALL})")
    if cfg.wandb_project:
        folder = cfg.wandb_save_dir or os.path.join(save_dir or ".", "wandb")
        try:
            writers.append(WandbWriter(cfg.wandb_project, cfg.wandb_exp_name, folder,
                                       run_config, print_fn))
        except ImportError:
            print_fn(f"wandb is not installed: --wandb-project ignored "
                     f"(pip install wandb, or {INSTALL})")
    return writers
