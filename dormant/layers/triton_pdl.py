"""Programmatic dependent launch (PDL) for the decode kernels: a kernel launched with
``launch_pdl=True`` may start while the kernel before it in the stream still runs.

At batch 1 a decode layer is a chain of small kernels, and each launch leaves a gap in which
the GPU drains one kernel and ramps up the next (the MoE batch-1 step on the H200: about 66 us
of kernels a layer in about 85 us). With PDL the next kernel's programs are resident when the
previous kernel ends; each may read what the previous kernel does not write (weights), then
waits in ``gdc_wait`` until that kernel has finished, its writes visible.

Each kernel module has two knobs, read at each call (so at graph capture): ``USE_PDL_AT_BATCH_1``
for launches over one row (a batch-1 decode step) and ``USE_PDL_ABOVE_BATCH_1`` for every other
launch (larger decode batches, prefill); ``pdl_for`` picks between them. Behind a cuBLAS GEMM
(launched plainly, never triggering early) a PDL kernel can launch only as the GEMM's programs
exit, so most of the gain is behind another PDL kernel, which triggers right after its wait.

The rules a PDL kernel keeps (the hardware checks none of them):
- before ``gdc_wait`` it reads only what no kernel of the step writes (weights), or what a
  kernel before the previous one wrote, where the previous one triggers only after its wait
  (or launches plainly): that kernel had finished before ours could start (a step input such
  as the positions or the slot mapping, written before the layers run, is read so by the
  rotary kernel and the KV write);
- it writes nothing before ``gdc_wait`` (the previous kernel may still read it);
- it calls ``gdc_launch_dependents`` only after its own ``gdc_wait``, so the next kernel's
  pre-wait reads see everything ours waited for: the chain stays transitive;
- after the wait it reads what the previous kernel wrote with ``.cg`` (from L2): this SM's L1
  may hold a line of an earlier layer's buffer at the same graph-pool address.

``gdc_wait`` and ``gdc_launch_dependents`` are inline PTX (sm_90 and later); Triton's interpreter
runs no inline assembly, so a kernel takes them only under a ``USE_PDL`` constexpr that
``is_pdl_available`` sets, never on the CPU.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _is_sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def is_pdl_available(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched with PDL: CUDA, compute capability 9.0+."""
    if device.type != "cuda":
        return False
    return _is_sm90_or_later(device.index if device.index is not None else 0)


def use_pdl(requested: bool | None, default: bool, device: torch.device) -> bool:
    """``requested`` (``default`` when None), and only where the device has PDL."""
    return (default if requested is None else requested) and is_pdl_available(device)


def pdl_for(
    rows: int, requested: bool | None, at_batch_1: bool, above_batch_1: bool, device: torch.device
) -> bool:
    """Whether a launch over ``rows`` rows (tokens, or sequences) takes PDL: ``requested`` when
    given, else the module's knob for its size (``at_batch_1`` for one row, ``above_batch_1``
    for more); never where the device has no PDL."""
    return use_pdl(requested, at_batch_1 if rows == 1 else above_batch_1, device)
