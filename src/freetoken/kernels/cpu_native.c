/* freetoken's native CPU library: routed experts read straight from the host expert pool, dense
 * layers of decode batches (stored or kept quantized), decode attention over the paged KV cache,
 * a decode step's RMSNorm and rotary embedding, and the listener that takes the device's
 * doorbell. This file is the library's one translation unit: it includes the parts below.
 *
 * Built at first use by kernels/native.py with the machine's own compiler (-O3 -march=native),
 * so the parts' inner loops become AVX-512 (or AVX2) code on the machine that runs them.
 * `ft_cpu_experts_submit` hands a job to this library's own team of threads and returns at
 * once; `ft_cpu_experts_wait` takes part in the job's remaining work, then blocks until it is
 * done (called through ctypes, which releases the GIL meanwhile). No Python thread is involved:
 * a Python thread would need the GIL to start the job, and the thread driving the GPU holds it
 * for milliseconds at a time while it launches kernels.
 *
 * The team takes work items from a shared counter rather than a fixed share each (as an OpenMP
 * static schedule would): a thread that wakes late, or shares its core with the thread driving
 * the GPU, then finishes fewer items instead of holding up the whole job. With OpenMP's static
 * schedule the GPU host's CPU path ran at half its bandwidth beside the GPU thread.
 *
 * Decode runs a few tokens through a few experts: matrix-vector products, bound by how fast
 * weights stream from DRAM. Every weight row is read once per call (the tokens of a group that
 * share an expert are multiplied while the row sits in L1), 64 elements per step into four
 * independent 16-wide accumulators so enough loads are in flight. torch's bf16 GEMV reached
 * 40 GB/s on the GPU host's CPU where a loop like this one reached 64.
 *
 * Experts kept quantized (fp8, mxfp4, nvfp4, GGUF's types: see cpu_formats.c) are decoded as
 * they are read, into the values their dequantized copy holds, and go through the same
 * arithmetic.
 *
 * Results follow the torch reference (kernels/grouped_reference.py) rounding step for step: for
 * bf16 banks the projections, the activation, its product with up, the down projection and the
 * gate-weighted contribution are each rounded to bf16 where torch rounds them; only the
 * accumulation order inside a dot product differs. Contributions are summed per token in fp32,
 * by expert id and then in the caller's route order.
 *
 * The parts, by concern, in the order they are included (none compiles alone), each with the
 * Python module that binds it: declares the ctypes signatures of its exported functions (through
 * kernels/cpu_team.py's `declare`) and calls them.
 *
 *   cpu_native.h    the build's switches, the types the parts share (a projection, a quantized
 *                   row, a job), bf16 helpers, atomics, the team's items, the exported functions
 *   cpu_formats.c   the quantized formats: their rows, value tables, scalar decoders  cpu_banks.py
 *   cpu_decoders.c  the AVX-512 and AVX2 decoders, decode_range                       cpu_banks.py
 *   cpu_dots.c      dot products of weight rows with x: dense, and quantized rows decoded in
 *                   registers (qdot_*; GGUF's scaled codes)
 *   cpu_team.c      the team of threads: jobs and their items, the clock, scratch      cpu_team.py
 *   cpu_experts.c   the routed experts' jobs                                         cpu_experts.py
 *   cpu_layers.c    dense layers, decode attention, RMSNorm, rotary embeddings  cpu_linear.py,
 *                                                           paged_attention.py, norm_rope.py
 *   cpu_listener.c  the device's doorbell's listener                             moe/doorbell.py
 *
 * One translation unit, not one object per part linked together: the hot paths cross the parts
 * (an expert item's weight_row and row_dot, in cpu_experts.c, call the decoders and qdot_* of
 * cpu_decoders.c and cpu_dots.c, whose helpers the compiler inlines into the items' loops; the
 * value tables and the per-thread table caches are statics they share). Compiled apart, those
 * calls would stay calls (short of link-time optimisation, which the machine's compiler may not
 * do) and every shared helper would need exporting; as one unit the compiler sees what it saw
 * when the library was one file (cpu_experts.c until issue 44): each function's instructions were
 * the same after the split as before, in every build the tests make (objdump, gcc 12). Each part
 * uses what the header and the parts before it define (the team's run_items, in cpu_team.c,
 * reaches the items defined after it through the header's prototypes). kernels/native.py compiles
 * this file and names the cached library by a hash of it and of every file it includes, so a
 * change to any part rebuilds it.
 */
#include "cpu_native.h"

#include "cpu_formats.c"
#include "cpu_decoders.c"
#include "cpu_dots.c"
#include "cpu_team.c"
#include "cpu_experts.c"
#include "cpu_layers.c"
#include "cpu_listener.c"
