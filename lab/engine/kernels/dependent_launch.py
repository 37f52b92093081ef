"""Programmatic dependent launch (PDL, sm_90 and newer): a kernel launched with it may have its
programs placed on the SMs while the kernel before it is still finishing, and waits inside for
that kernel's completion. A batch-1 decode step is about 200 short kernels back to back, and the
gap between two of them (the next launch, the placement of its programs) is a cost the bytes
floor does not count; PDL overlaps it with the previous kernel's tail. Engine knob `pdl`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dependent_launch_prologue():
    """First thing a kernel launched with PDL does: wait until the kernel before this one has
    finished and its writes are visible, then let the next kernel's programs be placed. Waiting
    before any load or store keeps every read-after-write and write-after-read between the two in
    order; what overlaps is the next launch and its programs' placement with this kernel's body.
    Releasing the next kernel before waiting cascades: it releases the one after it while this one
    still waits, and so on down the step, until programs that can only wait fill the SMs."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


def pdl_arguments(pdl: bool) -> dict:
    """Launch keywords for a kernel with a `PDL` constexpr: nothing when off, so the interpreter
    (which has no launch options) and older launch paths see the call unchanged."""
    return {"PDL": True, "launch_pdl": True} if pdl else {}
