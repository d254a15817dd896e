"""What this box offers the GPU check, in one line (and a JSON file): the packages each step needs, and
what the installed torch's varlen_attn offers the kernel rule (``scripts/gpu_check.sh``'s first step).

    python scripts/gpu_facts.py OUT/facts.json [--cpu]

Exit code 0 when torch imports (and, without ``--cpu``, a CUDA device is there); a missing optional package
is named in the line with the step it changes, never an error.
"""
from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# package -> what lacks without it (None: required by every step)
PACKAGES = {
    "torch": None,
    "numpy": "selftest, profile",
    "pytest": "tests step",
    "transformers": "gpu_step's HF groups (flexsp hf vs hf each)",
    "liger-kernel": "the LM-head loss falls back to FlexSP's own (the gpu extra's kernel unmeasured)",
    "hypothesis": "nothing here (property tests are not run on the GPU box)",
}


def version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def kernel_facts() -> dict:
    import torch

    from flexsp.runtime.kernels import LengthMix, choose, device_facts, varlen
    facts = device_facts("cuda" if torch.cuda.is_available() else "cpu")
    api = varlen.VARLEN
    mixes = {"33,792 mixed": (0, 16384, 24576, 28672, 30720, 31744, 32768, 33280, 33792), "idle dummy": (0, 1),
             "64 x 512": tuple(range(0, 64 * 512 + 1, 512))}
    return {
        "device_facts": {"device": facts.device_type, "capability": facts.capability, "cudnn": facts.cudnn,
                         "varlen": facts.varlen, "varlen_selects": facts.varlen_selects, "flash_attn": facts.flash,
                         "cudnn_varlen": facts.cudnn_varlen, "cudnn_missing": facts.cudnn_missing()},
        "varlen_api": None if api is None else {"causal_arg": api.causal_arg, "scale": api.scale, "gqa": api.gqa,
                                                "selects": api.selects, "select_hook": api.select is not None,
                                                "backward_args": list(api.backward_args)},
        "auto_kernel_bf16_dim128": {name: choose(facts, torch.bfloat16, 128, LengthMix.of(b)) for name, b in mixes.items()},
    }


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else None
    cpu = "--cpu" in argv
    have = {name: version(name) for name in PACKAGES}
    try:
        import torch
        have["torch"] = torch.__version__
    except ImportError:
        have["torch"] = None
    if have["torch"] is None:
        print("missing: torch (required by every step): nothing can run")
        return 2
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "no CUDA device"
    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device, "packages": have,
             "cudnn": torch.backends.cudnn.version() if cuda else None}
    try:
        facts.update(kernel_facts())
    except Exception as exc:      # an import error of flexsp itself is a finding, not a crash of the check
        facts["kernel_facts_error"] = f"{type(exc).__name__}: {exc}"
    missing = [f"{n} ({why})" for n, why in PACKAGES.items() if have[n] is None]
    kernel = facts.get("device_facts", {})
    print(f"box: {device}, torch {torch.__version__}, cuDNN {facts['cudnn']}; "
          + ", ".join(f"{n} {v}" for n, v in have.items() if v and n != "torch")
          + f" | missing: {'; '.join(missing) if missing else 'nothing'}"
          + f" | varlen selects by sdpa_kernel: {kernel.get('varlen_selects')}, varlen_cudnn offered: "
            f"{kernel.get('cudnn_varlen')} ({kernel.get('cudnn_missing') or 'all there'})")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(facts, indent=1, default=str) + "\n")
    if not cpu and not cuda:
        print("no CUDA device: run the rehearsal with FLEXSP_GPU_CHECK_CPU=1")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
