"""What vlforge sets in the libraries under it when a model loads (and when the CLI starts), so
that a run contacts no network and prints only its own lines and warnings the user can act on.

- The Hugging Face Hub goes offline (`HF_HUB_OFFLINE=1`) unless the user set `HF_HUB_OFFLINE`
  (or `TRANSFORMERS_OFFLINE`) themselves: vlforge loads local directories and built-in presets and
  never downloads, but bitsandbytes (0.50), at its import on a CPU with AVX512-BF16, asks the Hub
  for a CPU 4-bit kernel (`kernels-community/quantization-bitsandbytes`) through `kernels`, which
  first asks the Hub whether the kernel's publisher is trusted: a network contact at the start of
  every command (peft imports bitsandbytes). Offline, `kernels` looks in its local cache only (a
  kernel downloaded before still loads) and makes no request.
- Offline, that lookup's two notices (kernels': the trust check skipped; bitsandbytes': no kernel,
  so its own built-in CPU code runs) are dropped: nothing in them is for a vlforge user to act on.
  These two records only, by a filter on the two libraries' loggers: every other record of theirs passes.
- peft (0.21) reads `model.is_gradient_checkpointing`, which transformers 5 deprecated with a
  FutureWarning, when it wraps a model (LoRA) or loads an adapter (export, resume): a warning
  about peft's code, which only a newer peft fixes. That one warning is ignored.

Set when called, never at import: importing vlforge changes no process-wide setting.
"""

from __future__ import annotations

import logging
import os
import warnings

HUB_KERNEL_NOTICES = {
    # logger name: the start of the one message dropped from it
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
    "kernels._internals.hf_hub": "Skipping publisher trust check for 'kernels-community/",
}


class _HubKernelNotice(logging.Filter):
    """Drops one logger's records that start with `prefix`; the others pass."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def offline_and_quiet() -> None:
    """Set the process offline for the Hub (unless the user chose) and drop the notices above.
    Idempotent; before or after the libraries' import (their loggers and warnings are looked up
    by name, and the Hub's offline flag is read at each call)."""
    if "HF_HUB_OFFLINE" not in os.environ and "TRANSFORMERS_OFFLINE" not in os.environ:
        os.environ["HF_HUB_OFFLINE"] = "1"  # for processes started from here, and libraries imported later
        try:
            import huggingface_hub.constants as hub  # read the variable at its import: set it there too
        except ImportError:
            hub = None
        if hub is not None:
            hub.HF_HUB_OFFLINE = True
    if hub_offline():  # online because the user said so: what bitsandbytes fetches and says is theirs
        for name, prefix in HUB_KERNEL_NOTICES.items():
            logger = logging.getLogger(name)
            if not any(isinstance(f, _HubKernelNotice) for f in logger.filters):
                logger.addFilter(_HubKernelNotice(prefix))
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                            module=r"transformers\.modeling_utils")


def hub_offline() -> bool:
    """Whether the Hub client makes no requests in this process (huggingface_hub's own answer)."""
    try:
        from huggingface_hub.constants import is_offline_mode
    except ImportError:  # no Hub client: nothing can ask the Hub
        return True
    return is_offline_mode()
