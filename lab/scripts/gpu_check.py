"""The GPU check: one command for everything this project needs a GPU for, in at most 9 minutes.

    python -m lab.scripts.gpu_check --out runs/gpu_check

Steps, each in its own process with its own time limit (a failed or timed-out step is
reported and the next one runs):

1. ``environment``: torch, CUDA, the card, the kernel ``dilated_attention`` picks per dtype;
2. ``cuda tests``: ``tests/gpu`` (fp32/bf16/fp16 against float64, relative to SDPA computing the
   same function, 20 draws per case; every CUDA kernel by name; misaligned views; a million
   tokens forward + backward; the model's training step and KV-cache generation);
3. ``compute-sanitizer``: memcheck of a small bf16 and fp16 forward + backward with each CUDA
   kernel (skipped when ``compute-sanitizer`` is not on the PATH);
4. ``attention benchmark``: ``bench_attention.py --device cuda``, bf16, 16 heads of 64, causal,
   the geometric pattern, 8K to 128K tokens, against SDPA per backend; then (``... long``) 512K
   against SDPA's own choice and 1M alone;
5. ``training step``: ``bench_training.py --device cuda``, ``longnet-base`` in bf16, dilated
   against its dense twin at 8K and 32K, then 128K alone (it may not fit: its own step);
6. ``cli``: ``longnet fit --config configs/smoke.yaml`` on the GPU in bf16-mixed.

Everything lands in ``--out``: ``gpu_check.md`` (the summary: each step's status, time and the
lines that matter), each step's log, the benchmark blocks and plots. The process exits 1 if
any step failed.

On a machine without the packages the project's data and CLI layers need (``datasets``,
``jsonargparse``, ...), put their wheels in a folder and pass ``--wheels DIR``: they are
installed into a temporary site folder first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's longnet, installed or not (the steps: PYTHONPATH)

from longnet.files import check_output_folder  # noqa: E402  (no torch, no data layer)
from longnet.validation import UsageError  # noqa: E402

ENVIRONMENT = """
import torch
from longnet.attention.kernels import select_kernel
print("torch", torch.__version__, "cuda", torch.version.cuda)
device = torch.device("cuda")
print("device", torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    print("kernel", dtype, select_kernel(device, dtype, 64).name)
"""

SANITIZED = """
import torch
from longnet.attention import dilated_attention
from longnet.attention.kernels import KERNELS
device = torch.device("cuda")
for kernel in (k for k in KERNELS if k.device == "cuda"):
    for dtype in (torch.bfloat16, torch.float16):
        if kernel.unsupported(device, dtype, 64):
            continue
        q, k, v = (torch.randn(2, 77, 4, 64, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        out = dilated_attention(q, k, v, [(10, 1), (30, 3)], causal=True, kernel=kernel.name)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print("sanitized", kernel.name, dtype)
"""


def steps(out: Path) -> list[tuple[str, list[str], int]]:
    """``(name, command, time limit in seconds)`` of every step."""
    python = sys.executable
    bench = [python, "-m", "lab.scripts.bench_attention", "--device", "cuda", "--dtype", "bfloat16",
             "--heads", "16", "--head-dim", "64", "--causal", "--pattern", "geometric"]
    training = [python, "-m", "lab.scripts.bench_training", "--model", "longnet-base",
                "--precision", "bf16", "--device", "cuda", "--steps", "3", "--out", str(out)]
    sanitizer = shutil.which("compute-sanitizer")
    runs = Path(tempfile.gettempdir()) / "gpu_check_runs"  # checkpoints: not worth carrying back
    return [
        ("environment", [python, "-c", ENVIRONMENT], 25),
        ("cuda tests", [python, "-m", "pytest", "tests/gpu", "-q", "-s", "-m", "gpu",
                        "-p", "no:cacheprovider", "--durations=12", "-o", "timeout=90"], 180),
        ("compute-sanitizer", [sanitizer, "--tool", "memcheck", "--error-exitcode", "9",
                               python, "-c", SANITIZED] if sanitizer else [], 45),
        ("attention benchmark", [*bench, "--lengths", "8192", "32768", "131072", "--repeats",
                                 "5", "--sdpa-max-len", "131072", "--tag", "geometric-bf16",
                                 "--out", str(out), "--json", str(out / "bench_attention.json")],
         75),
        ("attention benchmark long", [*bench, "--lengths", "524288", "1048576", "--repeats", "3",
                                      "--systems", "ours", "sdpa", "--sdpa-max-len", "524288",
                                      "--tag", "geometric-bf16-long", "--out", str(out), "--json",
                                      str(out / "bench_attention_long.json")], 65),
        ("training step", [*training, "--lengths", "8K", "32K"], 55),
        ("training step 128K", [*training, "--lengths", "128K", "--systems", "dilated",
                                "--tag", "longnet-base-bf16-128k",
                                "--json", str(out / "bench_training_128k.json")], 30),
        ("cli", [python, "-m", "longnet", "fit", "--config", "configs/smoke.yaml",
                 "--trainer.accelerator", "gpu", "--trainer.precision", "bf16-mixed",
                 "--trainer.default_root_dir", str(runs),
                 "--trainer.logger.init_args.save_dir", str(runs)], 45),
    ]


KEY_LINES = ("ERRORS", "kernel ", "device ", "passed", "failed", "error", "Error", "ours",
             "sdpa", "dilated @", "ERROR SUMMARY", "bits per byte", "|")


def run_step(name: str, command: list[str], limit: int, out: Path, env: dict) -> dict:
    """Run one step, its output to ``out/<name>.log``; its status, seconds and key lines."""
    log = out / f"{name.replace(' ', '_')}.log"
    if not command:
        return {"name": name, "status": "skipped", "seconds": 0.0,
                "lines": ["compute-sanitizer is not on the PATH"]}
    started = time.monotonic()
    with log.open("w") as sink:  # streamed: a step that times out still leaves its output
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=sink,
                                  stderr=subprocess.STDOUT, timeout=limit)
            status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit} s"
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if any(key in line for key in KEY_LINES)]
    return {"name": name, "status": status, "seconds": time.monotonic() - started,
            "lines": lines[-40:]}


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, before looking for a GPU, what would fail later: an empty or unwritable
    ``--out``, a ``--wheels`` that is no folder, an ``--only`` naming no step; sets ``args.out``
    and ``args.wheels`` to paths.

    Raises:
        UsageError: naming the option, the value and the fix.
    """
    for option in ("out", "wheels"):
        text = getattr(args, option)
        if text is not None and not text.strip():
            raise UsageError(f"--{option}: expected a path, got {text!r}.")
    args.out = Path(args.out)
    names = [name for name, _, _ in steps(args.out)]
    for name in args.only or ():
        if name not in names:
            raise UsageError(f"--only {name}: no such step; the steps: {', '.join(names)}.")
    if args.wheels is not None:
        args.wheels = Path(args.wheels)
        if not args.wheels.is_dir():
            raise UsageError(f"--wheels {args.wheels}: no such folder; give the folder of the "
                             "wheels to install.")
    check_output_folder(args.out, ["gpu_check.md"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"))
    parser.add_argument("--wheels", help="install the wheels of this folder first (offline)")
    parser.add_argument("--only", nargs="+", help="run only these steps (by name)")
    args = parser.parse_args(argv)
    try:
        check_arguments(args)
    except UsageError as error:
        print(f"gpu_check.py: {error}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_check.py: no CUDA device is visible; this check needs one.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    site = None
    if args.wheels is not None:
        site = tempfile.mkdtemp(prefix="gpu_check_site_")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--target", site, *map(str, sorted(args.wheels.glob("*.whl")))],
                       check=True)
    paths = [site, str(ROOT), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, paths)))
    results = []
    for name, command, limit in steps(args.out):
        if args.only and name not in args.only:
            continue
        result = run_step(name, command, limit, args.out, env)
        results.append(result)
        print(f"{name}: {result['status']} in {result['seconds']:.0f} s", flush=True)
    summary = ["# GPU check", ""]
    summary += ["| step | status | s |", "|---|---|---|"]
    summary += [f"| {r['name']} | {r['status']} | {r['seconds']:.0f} |" for r in results]
    for result in results:
        summary += ["", f"## {result['name']}: {result['status']}", "", "```",
                    *result["lines"], "```"]
    (args.out / "gpu_check.md").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 0 if all(r["status"] in ("passed", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
