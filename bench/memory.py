"""Benchmark of a CPU training process's peak memory: glibc's malloc as it comes against its mmap threshold held
fixed (``aitlrt.common.memory.unmap_freed_tensors``, what the GRPO and SFT trainers do on CPU), side by side in one
run.

Each measurement is a fresh process (the allocator's state is the process's): the bundled SmolLM2-135M in fp32 in
train mode, one forward and backward of its decoder over one row of random token ids (the loss on the last hidden
states: the trainer's LM head sees only the scored positions), with and without gradient checkpointing
(non-reentrant, transformers' default). Printed: the process's peak resident memory (``VmHWM``, what the kernel's
OOM killer weighs) and the seconds of the forward/backward, the two allocators in alternating order.

Run: ``python bench/memory.py`` (no arguments; ``--tokens 2048 4096``: the row lengths). No targets: the numbers
are read in the notebook (docs/decisions/0022-cpu-mmap-threshold.md).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

from aitlrt.common.procs import die_with_parent

ROOT = Path(__file__).resolve().parents[1]
MEASURE = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM
from aitlrt.common.memory import peak_memory_gib, reset_peak_memory, unmap_freed_tensors
from aitlrt.common.model import resolve_model
allocator, checkpointing, tokens = sys.argv[1], sys.argv[2] == "on", int(sys.argv[3])
if allocator == "fixed":
    assert unmap_freed_tensors(torch.device("cpu"))
model = AutoModelForCausalLM.from_pretrained(resolve_model("bundled"), dtype=torch.float32)
model.train()
if checkpointing:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
cpu = torch.device("cpu")
reset_peak_memory(cpu)
start = time.monotonic()
hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
hidden.pow(2).mean().backward()
print(json.dumps({"peak_gib": peak_memory_gib(cpu), "seconds": time.monotonic() - start}))
"""
ALLOCATORS = ("glibc default", "fixed")


def measure(allocator: str, checkpointing: bool, tokens: int) -> dict[str, float]:
    """One forward/backward in a fresh process: its peak resident GiB and seconds."""
    argv = [sys.executable, "-c", MEASURE, allocator.split()[0], "on" if checkpointing else "off", str(tokens)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, preexec_fn=die_with_parent(signal.SIGTERM))
    if done.returncode:
        raise SystemExit(f"[bench] the measurement failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    cli.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096], help="row lengths (default %(default)s)")
    args = cli.parse_args()
    cases = [(True, n) for n in args.tokens] + [(False, min(args.tokens))]
    rows = []
    for i, (checkpointing, tokens) in enumerate(cases):
        order = ALLOCATORS if i % 2 == 0 else ALLOCATORS[::-1]
        got = {a: measure(a, checkpointing, tokens) for a in order}
        for a in order:
            print(f"  checkpointing {'on' if checkpointing else 'off'}, {tokens} tokens, {a}: "
                  f"{got[a]['peak_gib']:.2f} GiB, {got[a]['seconds']:.1f} s", flush=True)  # fmt: skip
        rows.append((checkpointing, tokens, got))
    print(f"\n{'checkpointing':<14}{'tokens':>7}  {'peak GiB: glibc':>16}{'fixed':>7}{'ratio':>7}  "
          f"{'seconds: glibc':>15}{'fixed':>7}")  # fmt: skip
    for checkpointing, tokens, got in rows:
        (glibc, fixed), ckpt = (got[a] for a in ALLOCATORS), "on" if checkpointing else "off"
        ratio = fixed["peak_gib"] / glibc["peak_gib"]
        print(f"{ckpt:<14}{tokens:>7}  {glibc['peak_gib']:>16.2f}{fixed['peak_gib']:>7.2f}{ratio:>7.2f}  "
              f"{glibc['seconds']:>15.1f}{fixed['seconds']:>7.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
